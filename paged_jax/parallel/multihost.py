"""One engine over several hosts (``--nnodes N --node-rank R --master-addr A --master-port P``, vLLM's names).

Every host runs one process of one JAX job (``jax.distributed``; the coordinator is node 0 at ``A:P``), so the
meshes span all hosts' devices and every jitted step is one multi-controller SPMD program: each process must call
the same jitted functions, in the same order, with the same global shapes and the same host inputs. Node 0 owns the
engine loop (scheduler, KV-cache manager, detokenizer, HTTP); the others own no requests and run node 0's steps:

* ``StepChannel``: node 0's runner publishes, before any device call of it, each step it executes after warm-up (its
  ``SchedulerOutput``, msgspec-encoded by ``paged_jax.core.sched_output.encode_step``, and the step's LoRA slots; a
  grammar step's bitmask, which only node 0's matchers can fill), numbered, through the coordinator's key-value
  store (``jax.distributed``'s own client: small messages over its gRPC connection, no device collective, so
  nothing compiles for them). Warm-up needs no messages: every process compiles and runs the same fixed sequence.
* The followers' loop (``paged_jax.parallel.follower``) runs each step through its own runner's ``execute``: the
  same persistent batch, packing, swaps and dispatch as node 0's (one step path on every node).

A dead node: every node notices within seconds (``EngineArgs.distributed_timeout_seconds``,
``--distributed-timeout-seconds``), logs an error naming it and exits with status 1 (``paged_jax.parallel.rank_watch``).
"""

from __future__ import annotations

import logging
import pickle
from collections.abc import Sequence
from typing import Any

logger = logging.getLogger(__name__)

_KEY_PREFIX = "paged_jax/step/"
# A follower cannot fall more than a step or two behind (every step is a collective it takes part in), so keys
# this far back have been read by everyone and are deleted.
_KEEP_MESSAGES = 64


def start_distributed(args) -> bool:
    """Join the multi-host JAX job ``args`` describe (``EngineArgs.nnodes`` > 1: coordinator
    ``master_addr:master_port``, ``num_processes=nnodes``, ``process_id=node_rank``), or one that
    ``paged_jax.parallel.initialize_distributed`` finds in the environment, and start watching the other nodes
    (``rank_watch``: a dead one makes this process exit with status 1). Idempotent; True in a multi-process job.
    With ``weight_transfer_config`` the job (joined here from the environment if the caller has not) is the
    trainer's and this engine one process of it on its own devices: False, no watch
    (``paged_jax.parallel.weight_transfer``).

    Raises:
      ValueError: the job's process count disagrees with ``nnodes``.
    """
    import jax
    from jax._src.distributed import global_state  # jax.distributed's client (no public accessor)

    from paged_jax.parallel import rank_watch
    from paged_jax.parallel.mesh import initialize_distributed

    timeout = args.distributed_timeout_seconds or rank_watch.DEFAULT_TIMEOUT_S
    heartbeat = rank_watch.JAX_HEARTBEAT_FACTOR * timeout
    if args.weight_transfer_config is not None:
        initialize_distributed(heartbeat_timeout_seconds=heartbeat)
        return False
    if args.nnodes > 1:
        initialize_distributed(f"{args.master_addr}:{args.master_port}", args.nnodes, args.node_rank,
                               heartbeat_timeout_seconds=heartbeat)
    else:
        initialize_distributed(heartbeat_timeout_seconds=heartbeat)
    if args.nnodes > 1 and jax.process_count() != args.nnodes:
        raise ValueError(f"nnodes={args.nnodes} but the JAX job has {jax.process_count()} processes")
    if jax.process_count() == 1:
        return False
    rank_watch.start_watch(global_state.client, jax.process_index(), jax.process_count(),
                           global_state.coordinator_address, timeout)
    return True


def engine_devices(args, devices: Sequence | None) -> Sequence | None:
    """The devices an engine core runs on: ``devices`` when given; in a trainer's job (``weight_transfer_config``)
    this process's first ``pipeline_parallel_size * tensor_parallel_size`` (``jax.devices()`` lists the trainer's
    too); else None (the first of ``jax.devices()``: every host's in a multi-host job)."""
    import jax

    if devices is None and args.weight_transfer_config is not None:
        return jax.local_devices()[:args.pipeline_parallel_size * args.tensor_parallel_size]
    return devices


def local_copies(arrays: Sequence) -> tuple:
    """Replicated outputs of a step, as arrays this process can fetch: in a multi-process job an array spanning
    every host's devices cannot be copied to one host, its local replica can."""
    return tuple(a if a.is_fully_addressable else a.addressable_data(0) for a in arrays)


def leader_channel() -> "StepChannel | None":
    """Node 0 of a multi-process job: the ``StepChannel`` its runner announces its steps on (and, at exit,
    ``"shutdown"``, which ends the followers). None in a single-process run."""
    import atexit

    import jax

    if jax.process_count() == 1 or jax.process_index() != 0:
        return None
    channel = StepChannel()
    atexit.register(_shut_down_followers, channel)  # runs before jax.distributed's own shutdown (registered earlier)
    return channel


def _shut_down_followers(channel: "StepChannel") -> None:
    from paged_jax.parallel.rank_watch import close_watch

    close_watch()  # first, so that the followers' exits are not reported as deaths
    channel.publish("shutdown")


_agreements = 0  # calls of agree_on_smallest in this process: every process makes them in the same order


def agree_on_smallest(name: str, value: int, *, poll_s: float = 5.0) -> int:
    """The smallest of every process's ``value`` in a multi-process job (each publishes its own under
    ``paged_jax/agree/<n>/<name>/<rank>`` in the coordinator's key-value store, ``n`` counting this process's calls,
    and reads the others', waiting in slices of ``poll_s`` for as long as the job is alive: a dead node is
    ``rank_watch``'s business); ``value`` itself in a single-process run. For start-up quantities that are compiled
    shapes and must agree although each host computes them from its own devices (the KV pool's block count: the
    smallest fits every node)."""
    import jax

    global _agreements
    if jax.process_count() == 1:
        return int(value)
    from jax._src.distributed import global_state  # jax.distributed's client (no public accessor)

    prefix = f"paged_jax/agree/{_agreements}/{name}/"
    _agreements += 1
    client = global_state.client
    client.key_value_set_bytes(f"{prefix}{jax.process_index()}", str(int(value)).encode())
    values = [int(wait_for_key(client, f"{prefix}{rank}", int(poll_s * 1000), f"agreeing on {name}"))
              for rank in range(jax.process_count())]
    if min(values) != int(value):
        logger.warning("%s: this node computed %d, the nodes %s; using the smallest", name, value, values)
    return min(values)


def is_leader() -> bool:
    """Whether this process schedules (node 0, or the only process)."""
    import jax

    return jax.process_index() == 0


class StepChannel:
    """Node 0 -> every other node: the ordered steps its runner executes (``"step"``: ``encode_step``'s msgpack
    bytes; ``"bitmask"``: a grammar step's int32 bitmask; ``"shutdown"``), which the others run
    (``paged_jax.parallel.follower``).

    Messages are pickled tuples ``(kind, payload)`` under ``paged_jax/step/<n>`` in the coordinator's key-value
    store. A follower waits for the next one in slices of ``poll_s`` for as long as the job is alive (node 0 may be
    idle for hours); a dead node ends the job through ``rank_watch``, a lost coordinator raises RuntimeError.
    """

    def __init__(self, *, poll_s: float = 5.0):
        from jax._src.distributed import global_state  # jax.distributed's client (no public accessor)

        if global_state.client is None:
            raise RuntimeError("StepChannel needs jax.distributed to be initialized (start_distributed)")
        self._client = global_state.client
        self._next = 0
        self._poll_ms = int(poll_s * 1000)

    def publish(self, kind: str, payload: Any = None) -> None:
        """Node 0: send the next message (before making the device calls it describes)."""
        self._client.key_value_set_bytes(f"{_KEY_PREFIX}{self._next}", pickle.dumps((kind, payload), protocol=5))
        if self._next >= _KEEP_MESSAGES:
            self._client.key_value_delete(f"{_KEY_PREFIX}{self._next - _KEEP_MESSAGES}")
        self._next += 1

    def receive(self) -> tuple[str, Any]:
        """Nodes 1..N-1: the next message (blocks while node 0 is idle)."""
        data = wait_for_key(self._client, f"{_KEY_PREFIX}{self._next}", self._poll_ms,
                             f"waiting for step message {self._next}")
        self._next += 1
        return pickle.loads(data)


def wait_for_key(client, key: str, poll_ms: int, what: str) -> bytes:
    """The bytes under ``key`` in the coordinator's key-value store, waited for in slices of ``poll_ms`` for as long
    as the job is alive (the writer may be idle or still starting; a dead node is ``rank_watch``'s business).
    RuntimeError naming ``what`` when the coordinator is lost."""
    while True:
        try:
            return client.blocking_key_value_get_bytes(key, poll_ms)
        except Exception as exc:  # noqa: BLE001 - jax raises JaxRuntimeError for both cases
            if "DEADLINE_EXCEEDED" not in str(exc):
                raise RuntimeError(f"node 0 is gone: lost the coordinator while {what}: {exc}") from exc
