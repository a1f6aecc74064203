"""Nodes 1..N-1 of a multi-host engine (``paged_jax.parallel.multihost``): build the same engine as node 0, then
run node 0's steps from the ``StepChannel`` until it shuts down: each ``"step"`` is a ``SchedulerOutput``
(``paged_jax.core.sched_output.encode_step``) that the runner executes exactly as node 0's runner does (the same
persistent batch, packing, swaps and dispatch: one step path on every node); a step with grammar rows is followed by
its ``"bitmask"`` (the grammars' matchers are node 0's); ``"shutdown"`` ends the loop. The engine runs in a child
process (``rank_watch.run_supervised``), so that a dead node ends the job."""

from __future__ import annotations

import logging
import os
import sys

import jax

from paged_jax.core.sched_output import decode_step
from paged_jax.engine.core import EngineCore
from paged_jax.parallel.multihost import StepChannel
from paged_jax.parallel.rank_watch import close_watch, run_supervised

logger = logging.getLogger(__name__)


def run_follower(engine_args) -> int:
    """Nodes 1..N-1 (``paged-jax serve/generate --node-rank R``, R > 0): in a child process (``rank_watch.
    run_supervised``), build the same engine as node 0 (its share of the weights and KV pool, the same compiled
    steps), then replay node 0's steps until it shuts down. Returns the exit status: 0 after node 0's shutdown (or
    SIGTERM), 1 when a node is gone (logged, naming it)."""
    if engine_args.nnodes > 1:
        coordinator = f"{engine_args.master_addr}:{engine_args.master_port}"
    else:
        coordinator = os.environ.get("PAGED_JAX_COORDINATOR") or os.environ.get("JAX_COORDINATOR_ADDRESS")
    return run_supervised(_follow_here, (engine_args, logging.getLogger().getEffectiveLevel()), coordinator,
                          engine_args.node_rank)


# The follower's engine process logs to the inherited stderr, each line naming its node (as the engine process of
# ``paged-jax serve`` names itself EngineCore).
_FOLLOWER_LOG_FORMAT = "%(asctime)s %(levelname)s (node {rank} pid=%(process)d) %(name)s: %(message)s"


def _follow_here(engine_args, log_level: int) -> int:
    """``run_follower``'s child: the engine and ``follow``; its exit status."""
    logging.basicConfig(level=log_level, format=_FOLLOWER_LOG_FORMAT.format(rank=engine_args.node_rank),
                        stream=sys.stderr, force=True)
    try:
        core = EngineCore(engine_args)
        follow(core.runner, StepChannel())
    except ValueError as exc:
        logger.error("node %d cannot start: %s", engine_args.node_rank, exc)
        return 2
    except RuntimeError as exc:
        logger.error("node %d stops: %s", engine_args.node_rank, exc)
        return 1
    close_watch()
    return 0



def follow(runner, channel: StepChannel) -> None:
    """Nodes 1..N-1: run node 0's steps on this process's ``runner`` (built and warmed up exactly as node 0's)
    until node 0 sends ``"shutdown"``. Returns normally on shutdown; raises when node 0 is lost."""
    logger.info("node %d ready: following node 0's steps", jax.process_index())
    pending = None
    while True:
        kind, payload = channel.receive()
        if kind == "shutdown":
            logger.info("node 0 shut down; node %d exits", jax.process_index())
            return
        if kind != "step":
            raise RuntimeError(f"unexpected step message {kind!r} from node 0")
        scheduler_output, lora_slots = decode_step(payload)
        handle = runner.execute(scheduler_output, lora_slots, defer_sampling=True)
        if handle is None:
            continue
        if runner.waits_for_bitmask(handle):
            kind, bitmask = channel.receive()
            if kind != "bitmask":
                raise RuntimeError(f"node 0 sent {kind!r} where a step's grammar bitmask was due")
            runner.dispatch_sampling(handle, bitmask)
        # Nothing reads a follower's outputs; waiting for the previous step bounds how far its queue runs ahead.
        if pending is not None:
            pending.wait()
        pending = handle
