"""Data parallelism: ``data_parallel_size`` engine replicas behind one prefix-aware router (vLLM's DP load balancing).

``DataParallelEngine(engine_args)`` splits the devices into ``data_parallel_size`` groups of
``pipeline_parallel_size * tensor_parallel_size`` (replica r gets ``jax.devices()[r * g:(r + 1) * g]``) and builds one
``LLMEngine`` per group: each replica has its own scheduler, KV-cache manager and KV pool, and its mesh spans only
its own group. It implements the interface the server and ``LLM`` drive (``serving.engine_client.EngineClient``, plus
``step(finished_only=, stream_deltas=)``), so both use it unchanged; ``create_engine(args)`` picks it when
``data_parallel_size > 1``.

Routing (``DataParallelEngine.route``), once per request at ``add_request``: the replica whose prefix cache holds the
longest run of the prompt's leading full blocks (asked through ``KVCacheManager.is_cached`` on the prompt's chained
block hashes: a read-only query, hashes computed once and only as far as some replica still matches); on a tie
(e.g. no replica has any), the least loaded one (unfinished requests: running + waiting), then the lowest index.
A request stays on its replica until it finishes or is aborted.

Stepping: ``step()`` steps every replica with work, each on its own thread of a pool (the device work of the
replicas overlaps: JAX releases the GIL while a replica waits for its device), and returns their outputs together.
A replica is only ever touched by one thread at a time: ``add_request`` / ``abort_request`` run on the caller's
thread between steps (the one-thread contract of ``LLMEngine`` holds for the whole object).

Stats: ``stats()`` has every ``LLMEngine.stats`` key summed over the replicas (``kv_cache_usage``: the mean, the pools
being equal) plus ``"replicas"``: the list of each replica's own stats (the server's metrics label them
``engine="<r>"``, as vLLM does).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
from collections.abc import Iterable, Sequence

from paged_jax.config import EngineArgs
from paged_jax.core.kv_cache_manager import hash_block_tokens
from paged_jax.outputs import RequestOutput
from paged_jax.sampling_params import SamplingParams
from paged_jax.engine.step_outputs import StreamDeltas

logger = logging.getLogger(__name__)

_ROOT_HASH = b""  # the parent hash of a sequence's first block (as KVCacheManager chains them)


def create_engine(engine_args: EngineArgs, *, use_tqdm: bool = True):
    """The engine ``engine_args`` describe: an ``LLMEngine``, or a ``DataParallelEngine`` when
    ``data_parallel_size > 1``."""
    if engine_args.data_parallel_size > 1:
        return DataParallelEngine(engine_args, use_tqdm=use_tqdm)
    from paged_jax.engine.llm_engine import LLMEngine

    return LLMEngine(engine_args, use_tqdm=use_tqdm)


def replica_device_groups(engine_args: EngineArgs, devices: Sequence | None = None) -> list[list]:
    """The device list of each replica: consecutive groups of ``pipeline_parallel_size * tensor_parallel_size``.

    Raises:
      ValueError naming ``data_parallel_size`` when there are not enough devices.
    """
    import jax

    devices = list(jax.devices() if devices is None else devices)
    group = engine_args.pipeline_parallel_size * engine_args.tensor_parallel_size
    needed = engine_args.data_parallel_size * group
    if len(devices) < needed:
        raise ValueError(
            f"data_parallel_size * pipeline_parallel_size * tensor_parallel_size = {engine_args.data_parallel_size} "
            f"* {engine_args.pipeline_parallel_size} * {engine_args.tensor_parallel_size} = {needed} devices needed, "
            f"only {len(devices)} available ({devices[0].platform})")
    return [devices[r * group:(r + 1) * group] for r in range(engine_args.data_parallel_size)]


class DataParallelEngine:
    """``data_parallel_size`` ``LLMEngine`` replicas and a router; the ``LLMEngine`` interface the server uses.

    Attributes (as ``LLMEngine``'s, from replica 0; every replica loads the same model): ``tokenizer``,
    ``max_model_len``, ``vocab_size``, ``eos_token_ids``, ``model_path``, ``model_config``, ``generation_config``,
    ``engine_args`` (the given ones, ``data_parallel_size`` included); ``engines``: the replicas.
    """

    def __init__(self, engine_args: EngineArgs, *, use_tqdm: bool = True, devices: Sequence | None = None):
        from paged_jax.engine.llm_engine import LLMEngine
        from paged_jax.parallel.multihost import start_distributed

        if start_distributed(engine_args):
            raise ValueError("data_parallel_size > 1 runs on one host; a multi-host job takes tensor / pipeline "
                             "parallelism only")
        self.engine_args = engine_args
        replica_args = dataclasses.replace(engine_args, data_parallel_size=1)
        groups = replica_device_groups(engine_args, devices)
        self.engines: list[LLMEngine] = []
        for index, group in enumerate(groups):
            logger.info("data-parallel replica %d of %d on %s", index, len(groups), [str(d) for d in group])
            self.engines.append(LLMEngine(replica_args, use_tqdm=use_tqdm, devices=group))
        first = self.engines[0]
        self.tokenizer = first.tokenizer
        self.max_model_len = first.max_model_len
        self.vocab_size = first.vocab_size
        self.eos_token_ids = first.eos_token_ids
        self.model_path = first.model_path
        self.model_config = first.model_config
        self.generation_config = first.generation_config
        self.block_size = engine_args.block_size
        self._replica_of: dict[str, int] = {}  # unfinished request id -> replica index
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=len(self.engines),
                                                           thread_name_prefix="paged-jax-dp")

    # ------------------------------------------------------------------ routing
    def route(self, prompt_token_ids: Sequence[int]) -> int:
        """The replica for a prompt: longest cached prefix of full blocks, then least loaded, then lowest index."""
        candidates = list(range(len(self.engines)))
        if self.engine_args.enable_prefix_caching:
            parent, block_size = _ROOT_HASH, self.block_size
            for start in range(0, len(prompt_token_ids) - block_size + 1, block_size):
                parent = hash_block_tokens(parent, prompt_token_ids[start:start + block_size])
                matching = [r for r in candidates if self.engines[r].kv_cache_manager.is_cached(parent)]
                if not matching:
                    break
                candidates = matching  # these hold one more block of the prefix than the others
        return min(candidates, key=lambda r: (self.engines[r].get_num_unfinished_requests(), r))

    def replica_of(self, request_id: str) -> int | None:
        """The replica an unfinished request runs on (None if unknown or finished)."""
        return self._replica_of.get(request_id)

    # ------------------------------------------------------------------ EngineClient
    def add_request(self, request_id: str, prompt: str | Sequence[int] | dict, params: SamplingParams | None = None,
                    priority: int = 0, arrival_time: float | None = None, lora_request=None) -> None:
        """Route and queue a request (``LLMEngine.add_request``'s arguments and ValueErrors; ``enable_lora`` is
        refused with data parallelism, so a ``lora_request`` gets the replica's "LoRA is not enabled" error)."""
        if isinstance(request_id, str) and request_id in self._replica_of:
            raise ValueError(f"request_id {request_id!r} is already in use by an unfinished request")
        # The router needs the ids; the replica tokenizes again so its outputs carry the prompt text as given.
        _, token_ids = self.engines[0]._tokenize_prompt(prompt)
        replica = self.route(token_ids)
        self.engines[replica].add_request(request_id, prompt, params, priority=priority, arrival_time=arrival_time,
                                          lora_request=lora_request)
        self._replica_of[request_id] = replica

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        by_replica: dict[int, list[str]] = {}
        for rid in ids:
            replica = self._replica_of.pop(rid, None)
            if replica is not None:
                by_replica.setdefault(replica, []).append(rid)
        for replica, rids in by_replica.items():
            self.engines[replica].abort_request(rids)

    def step(self, *, finished_only: bool = False, stream_deltas: StreamDeltas | None = None
             ) -> list[RequestOutput]:
        """One step of every replica with unfinished requests (concurrently); their outputs, replica by replica
        (``stream_deltas``: as ``LLMEngine.step``'s, each replica's rows in turn)."""
        busy = [engine for engine in self.engines if engine.has_unfinished_requests()]
        if len(busy) == 1:
            results = [busy[0].step(finished_only=finished_only, stream_deltas=stream_deltas)]
        else:
            # One column set per replica (their threads append concurrently), merged in replica order.
            columns = [None if stream_deltas is None else StreamDeltas() for _ in busy]
            futures = [self._pool.submit(engine.step, finished_only=finished_only, stream_deltas=replica_columns)
                       for engine, replica_columns in zip(busy, columns)]
            results = [future.result() for future in futures]
            if stream_deltas is not None:
                for replica_columns in columns:
                    stream_deltas.extend(replica_columns)
        outputs = [output for result in results for output in result]
        for output in outputs:
            if output.finished:
                self._replica_of.pop(output.request_id, None)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return any(engine.has_unfinished_requests() for engine in self.engines)

    def get_num_unfinished_requests(self) -> int:
        return sum(engine.get_num_unfinished_requests() for engine in self.engines)

    def get_tokenizer(self):
        return self.tokenizer

    def stats(self) -> dict:
        """Every ``LLMEngine.stats`` key summed over the replicas (``kv_cache_usage`` averaged), and
        ``"replicas"``: each replica's own stats, in replica order."""
        replicas = [engine.stats() for engine in self.engines]
        total: dict = {key: sum(stats[key] for stats in replicas) for key in replicas[0]}
        total["kv_cache_usage"] = total["kv_cache_usage"] / len(replicas)
        total["replicas"] = replicas
        return total

    def close(self) -> None:
        """Stop the stepping threads and the replicas' dispatch threads."""
        self._pool.shutdown(wait=True)
        for engine in self.engines:
            engine.runner.close()
