"""Data parallelism: ``data_parallel_size`` engine-core replicas behind one prefix-aware router (vLLM's DP load
balancing).

``DataParallelCore(engine_args)`` splits the devices into ``data_parallel_size`` groups of
``pipeline_parallel_size * tensor_parallel_size`` (replica r gets ``jax.devices()[r * g:(r + 1) * g]``) and builds one
``EngineCore`` per group: each replica has its own scheduler, KV-cache manager and KV pool, and its mesh spans only
its own group. It has ``EngineCore``'s interface, so one ``LLMEngine`` (one input and one output processor) drives it
in this process or in a core process; ``create_engine_core(args)`` picks it when ``data_parallel_size > 1``.

Routing (``DataParallelCore.route``), once per request at ``add_request``: the replica whose prefix cache holds the
longest run of the prompt's leading full blocks (asked through ``KVCacheManager.is_cached`` on the prompt's chained
block hashes: a read-only query, hashes computed once and only as far as some replica still matches); on a tie
(e.g. no replica has any), the least loaded one (unfinished requests: running + waiting), then the lowest index.
A request stays on its replica until it finishes or is aborted.

Stepping: ``step()`` steps every replica with work, each on its own thread of a pool (the device work of the
replicas overlaps: JAX releases the GIL while a replica waits for its device), and returns their outputs together.
A replica is only ever touched by one thread at a time: ``add_request`` / ``abort_requests`` run on the caller's
thread between steps (the one-thread contract of ``EngineCore`` holds for the whole object).

Stats: ``stats()`` has every ``EngineCore.stats`` key summed over the replicas (``kv_cache_usage``: the mean, the pools
being equal) plus ``"replicas"``: the list of each replica's own stats (the server's metrics label them
``engine="<r>"``, as vLLM does).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
from collections.abc import Iterable, Sequence

from paged_jax.config import EngineArgs
from paged_jax.core.block_hash import hash_block_tokens
from paged_jax.engine.core import EngineCore, add_all_or_none
from paged_jax.engine.messages import EngineCoreOutput, EngineCoreRequest
from paged_jax.parallel.multihost import start_distributed

logger = logging.getLogger(__name__)

_ROOT_HASH = b""  # the parent hash of a sequence's first block (as KVCacheManager chains them)


def create_engine_core(engine_args: EngineArgs, *, use_tqdm: bool = True):
    """The core ``engine_args`` describe: an ``EngineCore``, or a ``DataParallelCore`` when
    ``data_parallel_size > 1``."""
    if engine_args.data_parallel_size > 1:
        return DataParallelCore(engine_args, use_tqdm=use_tqdm)
    return EngineCore(engine_args, use_tqdm=use_tqdm)


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


class DataParallelCore:
    """``data_parallel_size`` ``EngineCore`` replicas and a router, with ``EngineCore``'s interface.

    Attributes (as ``EngineCore``'s, from replica 0; every replica loads the same model): ``info``, ``tokenizer``,
    ``model_config``, ``engine_args`` (the given ones, ``data_parallel_size`` included); ``cores``: the replicas.
    """

    def __init__(self, engine_args: EngineArgs, *, use_tqdm: bool = True, devices: Sequence | None = None):
        if start_distributed(engine_args):
            raise ValueError("data_parallel_size > 1 runs on one host; a multi-host job takes tensor / pipeline "
                             "parallelism only")
        self.engine_args = engine_args
        replica_args = dataclasses.replace(engine_args, data_parallel_size=1)
        groups = replica_device_groups(engine_args, devices)
        self.cores: list[EngineCore] = []
        for index, group in enumerate(groups):
            logger.info("data-parallel replica %d of %d on %s", index, len(groups), [str(d) for d in group])
            self.cores.append(EngineCore(replica_args, use_tqdm=use_tqdm, devices=group))
        first = self.cores[0]
        self.info, self.tokenizer, self.model_config = first.info, first.tokenizer, first.model_config
        self.block_size = engine_args.block_size
        self._replica_of: dict[str, int] = {}  # unfinished request id -> replica index
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=len(self.cores),
                                                           thread_name_prefix="paged-jax-dp")

    # ------------------------------------------------------------------ routing
    def route(self, prompt_token_ids: Sequence[int]) -> int:
        """The replica for a prompt: longest cached prefix of full blocks, then least loaded, then lowest index."""
        candidates = list(range(len(self.cores)))
        if self.engine_args.enable_prefix_caching:
            parent, block_size = _ROOT_HASH, self.block_size
            for start in range(0, len(prompt_token_ids) - block_size + 1, block_size):
                parent = hash_block_tokens(parent, prompt_token_ids[start:start + block_size])
                matching = [r for r in candidates if self.cores[r].kv_cache_manager.is_cached(parent)]
                if not matching:
                    break
                candidates = matching  # these hold one more block of the prefix than the others
        return min(candidates, key=lambda r: (self.cores[r].get_num_unfinished_requests(), r))

    def replica_of(self, request_id: str) -> int | None:
        """The replica an unfinished request runs on (None if unknown or finished)."""
        return self._replica_of.get(request_id)

    # ------------------------------------------------------------------ EngineCore's interface
    def add_request(self, request: EngineCoreRequest) -> None:
        """Route and queue a request (``EngineCore.add_request``'s ValueErrors)."""
        if request.request_id in self._replica_of:
            raise ValueError(f"request_id {request.request_id!r} is already in use by an unfinished request")
        replica = self.route(request.prompt_token_ids)
        self.cores[replica].add_request(request)
        self._replica_of[request.request_id] = replica

    def add_requests(self, requests: Iterable[EngineCoreRequest]) -> None:
        """All or none, as ``EngineCore.add_requests``."""
        add_all_or_none(self, requests)

    def abort_requests(self, request_ids: Iterable[str] = (), sequences: Iterable[tuple[str, int]] = ()) -> None:
        by_replica: dict[int, tuple[list, list]] = {}
        for request_id in request_ids:
            replica = self._replica_of.pop(request_id, None)
            if replica is not None:
                by_replica.setdefault(replica, ([], []))[0].append(request_id)
        for request_id, index in sequences:
            replica = self._replica_of.get(request_id)
            if replica is not None:
                by_replica.setdefault(replica, ([], []))[1].append((request_id, index))
        for replica, (ids, seqs) in by_replica.items():
            self.cores[replica].abort_requests(ids, seqs)

    def step(self) -> list[EngineCoreOutput]:
        """One step of every replica with unfinished requests (concurrently); their outputs, replica by replica."""
        busy = [core for core in self.cores if core.has_unfinished_requests()]
        if len(busy) == 1:
            results = [busy[0].step()]
        else:
            results = [future.result() for future in [self._pool.submit(core.step) for core in busy]]
        outputs = [output for result in results for output in result]
        for output in outputs:
            if output.finish_reason is not None and not self.has_request(output.request_id):
                self._replica_of.pop(output.request_id, None)
        return outputs

    def has_request(self, request_id: str) -> bool:
        replica = self._replica_of.get(request_id)
        return replica is not None and self.cores[replica].has_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return any(core.has_unfinished_requests() for core in self.cores)

    def get_num_unfinished_requests(self) -> int:
        return sum(core.get_num_unfinished_requests() for core in self.cores)

    def stats(self) -> dict:
        """Every ``EngineCore.stats`` key summed over the replicas (``kv_cache_usage`` averaged), and
        ``"replicas"``: each replica's own stats, in replica order."""
        replicas = [core.stats() for core in self.cores]
        total: dict = {key: sum(stats[key] for stats in replicas) for key in replicas[0]}
        total["kv_cache_usage"] = total["kv_cache_usage"] / len(replicas)
        total["replicas"] = replicas
        return total

    def add_lora(self, lora_request) -> bool:
        raise ValueError("lora_request: LoRA is not supported with data_parallel_size > 1")

    def remove_lora(self, lora_id: int) -> bool:
        raise ValueError("lora_id: LoRA is not supported with data_parallel_size > 1")

    def list_loras(self) -> set[int]:
        return set()

    def reset_prefix_cache(self) -> bool:
        return all([core.reset_prefix_cache() for core in self.cores])

    # RL rollouts (paged_jax.engine.rollout_control): every replica alike (a bad parameter is refused by the first,
    # before any replica changes).
    def update_weights(self, params) -> None:
        for core in self.cores:
            core.update_weights(params)

    def update_weights_from_disk(self, path: str) -> None:
        for core in self.cores:
            core.update_weights_from_disk(path)

    def sleep(self, level: int = 1) -> dict:
        """Every replica sleeps; the bytes in use summed over their devices (None where not reported)."""
        results = [core.sleep(level) for core in self.cores]
        return {key: None if any(r[key] is None for r in results) else sum(r[key] for r in results)
                for key in results[0]}

    def wake_up(self, tags: list[str] | None = None) -> None:
        for core in self.cores:
            core.wake_up(tags)

    def is_sleeping(self) -> bool:
        return any(core.is_sleeping() for core in self.cores)

    def pause_generation(self, mode: str = "abort") -> None:
        for core in self.cores:
            core.pause_generation(mode)

    def resume_generation(self) -> None:
        for core in self.cores:
            core.resume_generation()

    def is_paused(self) -> bool:
        return all(core.is_paused() for core in self.cores)

    def close(self) -> None:
        """Stop the stepping threads and the replicas' threads."""
        self._pool.shutdown(wait=True)
        for core in self.cores:
            core.close()
