"""``LLMEngine``: input processor -> engine core -> output processor (vLLM's name and API).

``add_request`` validates and tokenizes (``InputProcessor`` -> one ``EngineCoreRequest``) and hands the request to the
core; ``step()`` steps the core (``EngineCore.step`` in this process, or the next step's ``EngineCoreOutputs`` from a
core in its own process, ``paged_jax.engine.core_client.EngineCoreProcClient``), and the ``OutputProcessor`` turns
its token ids into delta ``RequestOutput`` s (detokenization, stop strings, logprobs, n / best_of / beam search as the
user sees them). Sequences a stop string ended are aborted in the core right after.

Thread-safety: none; one thread drives an engine (the offline ``LLM``, or ``serving.async_engine``'s engine thread).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable, Sequence

from paged_jax.config import EngineArgs
from paged_jax.engine.core import EngineCore
from paged_jax.engine.core_client import EngineCoreProcClient
from paged_jax.engine.input_processor import InputProcessor
from paged_jax.engine.output_processor import OutputProcessor
from paged_jax.outputs import RequestOutput
from paged_jax.parallel.data_parallel import create_engine_core
from paged_jax.sampling_params import BeamSearchParams, SamplingParams

logger = logging.getLogger(__name__)


class LLMEngine:
    """An inference engine over one model: add requests, call ``step()`` until none are left.

    Args:
      engine_args: ``EngineArgs`` (vLLM names). ``model=None`` loads the built-in SmolLM2-135M-Instruct.
      use_tqdm: show progress bars for weight loading / compilation.
      devices: the core's devices (default: the first local ones).
      engine_core: the core to drive instead of building one here: an ``EngineCore``-like object (a
        ``DataParallelCore``) or an ``EngineCoreProcClient`` (a core in another process).

    Attributes (read by the serving layer): ``tokenizer`` (None for dummy shapes without one), ``max_model_len``,
    ``vocab_size``, ``eos_token_ids``, ``engine_args``, ``model_path``, ``generation_config``, ``engine_core``,
    ``startup_timings``.
    """

    def __init__(self, engine_args: EngineArgs, *, use_tqdm: bool = True, devices: Sequence | None = None,
                 engine_core=None):
        self.engine_args = engine_args
        if engine_core is None:
            engine_core = (create_engine_core(engine_args, use_tqdm=use_tqdm) if devices is None
                           else EngineCore(engine_args, use_tqdm=use_tqdm, devices=devices))
        self.engine_core = engine_core
        self._process_core = self.engine_core if isinstance(self.engine_core, EngineCoreProcClient) else None
        self._in_process_core = isinstance(self.engine_core, EngineCore)
        info = self.engine_core.info
        self.info = info
        self.tokenizer = self.engine_core.tokenizer
        self.max_model_len, self.vocab_size = info.max_model_len, info.vocab_size
        self.eos_token_ids = list(info.eos_token_ids)
        self.max_num_seqs, self.max_num_batched_tokens = info.max_num_seqs, info.max_num_batched_tokens
        self.model_path, self.generation_config = info.model_path, dict(info.generation_config)
        self.startup_timings = dict(info.startup_timings)
        self.input_processor = InputProcessor(info, self.tokenizer, engine_args)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._group_ids = itertools.count()
        self._admitting: dict[int, list[str]] = {}  # group id -> its request ids, until a process core answers
        self._admissions: list[tuple[int, BaseException | None]] = []
        self._paused = False  # pause_generation: an in-process core then says when stepping has work

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, **kwargs) -> "LLMEngine":
        return cls(engine_args, **kwargs)

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt: str | Sequence[int] | dict,
                    params: SamplingParams | BeamSearchParams | None = None, priority: int = 0,
                    arrival_time: float | None = None, lora_request=None) -> None:
        """Queue a request (``InputProcessor.process`` says what ``prompt`` may be and what is refused, as a
        ValueError naming the field). With a core in another process this waits for the core's answer."""
        group_id = self.submit_requests([(request_id, prompt, params, priority, lora_request, arrival_time)])
        if self._process_core is None:
            self._admissions = [(g, e) for g, e in self._admissions if g != group_id]
            return
        error = self._process_core.wait_for_admission(group_id)
        del self._admitting[group_id]
        if error is not None:
            self.output_processor.abort_requests([request_id])
            raise error

    def submit_requests(self, requests: Sequence[tuple]) -> int:
        """Add ``[(request_id, prompt, params, priority[, lora_request[, arrival_time]])]`` all or none and return
        the group's id; its answer (None or the ValueError that refused it) comes from ``take_admissions()``: at once
        with a core in this process, after a later ``step()`` with one in another process (no round trip per
        request). Raises ValueError when the input processor refuses one of them (nothing is added)."""
        core_requests, texts = [], []
        request_ids = set()
        for request_id, prompt, params, priority, *rest in requests:
            if request_id in self.output_processor or request_id in request_ids:
                raise ValueError(f"request_id {request_id!r} is already in use by an unfinished request")
            lora_request, arrival_time = (list(rest) + [None, None])[:2]
            core_request, text = self.input_processor.process(request_id, prompt, params, priority, arrival_time,
                                                              lora_request)
            core_requests.append(core_request)
            texts.append(text)
            request_ids.add(request_id)
        group_id = next(self._group_ids)
        if self._process_core is not None:
            self._process_core.add_requests(core_requests, group_id)
            self._admitting[group_id] = [r.request_id for r in core_requests]
        else:
            self.engine_core.add_requests(core_requests)  # ValueError: nothing of the group stays
            self._admissions.append((group_id, None))
        for core_request, text in zip(core_requests, texts):
            self.output_processor.add_request(core_request, text)
        return group_id

    def take_admissions(self) -> list[tuple[int, BaseException | None]]:
        """``(group id, None or the error that refused the whole group)`` for every answer not taken yet."""
        if self._process_core is not None:
            for group_id, error in self._process_core.take_admissions():
                request_ids = self._admitting.pop(group_id, [])
                if error is not None:
                    self.output_processor.abort_requests(request_ids)
                self._admissions.append((group_id, error))
        admissions, self._admissions = self._admissions, []
        return admissions

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Abort requests (unknown or finished ids are ignored); their blocks are freed before the next step. No
        output is produced for an aborted request."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        ids = [r for r in ids if r in self.output_processor]
        if ids:
            self.output_processor.abort_requests(ids)
            self.engine_core.abort_requests(ids)

    def has_unfinished_requests(self) -> bool:
        """Requests added and not finished (or, with a process core, messages it has not answered yet)."""
        if self._paused and self._process_core is None:
            return self.engine_core.has_unfinished_requests()  # frozen or held requests do not step
        if self.output_processor.has_unfinished_requests():
            return True
        return self._process_core is not None and self._process_core.has_unanswered_messages()

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished_requests()

    # ------------------------------------------------------------------ the loop
    def step(self, *, finished_only: bool = False) -> list[RequestOutput]:
        """Run one engine step; returns the outputs of the requests that got a new token (finished ones included,
        with ``finished=True``), each the delta since the request's previous output. ``finished_only=True``
        (FINAL_ONLY) returns just the finished ones: a caller asking only those (``LLM.generate``) gets each
        generation whole. With a process core: the outputs of every core step finished since the last call
        (blocking for one while none came and requests are live; returning early on admissions or ``wakeup``)."""
        if self._in_process_core:  # a steady decode's outputs come as columns
            core_outputs, decode = self.engine_core.step_columns()
        else:
            core_outputs, decode = self.engine_core.step(), None
        if not core_outputs and self._process_core is not None and self._process_core.core_is_idle():
            self._drop_lost_requests()
        outputs, stopped = self.output_processor.process_outputs(core_outputs, finished_only, decode)
        if stopped:
            self.engine_core.abort_requests((), stopped)
        return outputs

    def _drop_lost_requests(self) -> None:
        """The process core has applied every message and holds none of this client's requests, so the ones still
        tracked here ended without a last output: drop them rather than wait for outputs that never come."""
        admitting = {r for ids in self._admitting.values() for r in ids}
        lost = [r for r in self.output_processor.request_ids() if r not in admitting]
        if lost:
            logger.warning("the engine core holds none of %d live requests; dropping them", len(lost))
            self.output_processor.abort_requests(lost)

    # ------------------------------------------------------------------ the core's utilities
    def stats(self) -> dict[str, float]:
        """The core's gauges and counters (``EngineCore.stats``' keys); with a process core its latest, counting
        requests not answered yet as waiting."""
        return self.engine_core.stats()

    def add_lora(self, lora_request) -> bool:
        """Load an adapter ahead of its requests (ValueError if it cannot be served); True if it was not loaded."""
        return self.engine_core.add_lora(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        return self.engine_core.remove_lora(lora_id)

    def list_loras(self) -> set[int]:
        return self.engine_core.list_loras()

    def reset_prefix_cache(self) -> bool:
        return self.engine_core.reset_prefix_cache()

    def get_tokenizer(self):
        return self.tokenizer

    # ------------------------------------------------------------------ RL rollouts (paged_jax.engine.rollout_control)
    def update_weights(self, params) -> None:
        """Replace the weights in place (in-process core only); a ValueError naming the parameter changes nothing."""
        self.engine_core.update_weights(params)

    def update_weights_from_disk(self, path: str) -> None:
        self.engine_core.update_weights_from_disk(path)

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.engine_core.init_weight_transfer_engine(init_info)

    def update_weights_from_distributed(self, names: list[str], dtype_names: list[str], shapes: list) -> None:
        self.engine_core.update_weights_from_distributed(names, dtype_names, shapes)

    def sleep(self, level: int = 1) -> dict:
        return self.engine_core.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.engine_core.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.engine_core.is_sleeping()

    def pause_generation(self, mode: str = "abort") -> None:
        """Stop scheduling ("abort" | "wait" | "keep"; ``RolloutControl.pause_generation``); ``is_paused()`` says when
        nothing runs any more."""
        self.engine_core.pause_generation(mode)
        self._paused = True

    def resume_generation(self) -> None:
        self.engine_core.resume_generation()
        self._paused = False

    def is_paused(self) -> bool:
        return self.engine_core.is_paused()

    # ------------------------------------------------------------------ a core in another process
    @property
    def core_in_process(self) -> bool:
        """Whether the core runs in this process (else it can die on its own and is closed with the engine)."""
        return self._process_core is None

    @property
    def shared_engine_process(self) -> bool:
        """Whether the core process serves other clients too (it then enforces the waiting bound itself)."""
        return self._process_core is not None and self._process_core.shared

    def set_step_stats_callback(self, callback) -> None:
        """Have ``callback(stats)`` called with each core step's stats (a process core's ``step()`` may bring
        several steps at once); in-process the caller reads ``stats()`` after each step."""
        if self._process_core is not None:
            self._process_core.on_step_stats = callback

    def wakeup(self) -> None:
        """Make a ``step()`` blocked on a process core return now (any thread); a no-op in-process."""
        if self._process_core is not None:
            self._process_core.wakeup()

    def is_alive(self) -> bool:
        """Whether the core runs (a process core's process is alive); any thread."""
        return self._process_core is None or self._process_core.is_alive()

    def close(self, timeout: float = 30.0) -> None:
        """Stop the core (a process core's process; this process's runner threads)."""
        if self._process_core is not None:
            self._process_core.close(timeout)
        else:
            self.engine_core.close()
