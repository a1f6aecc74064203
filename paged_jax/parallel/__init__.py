"""Parallelism on ``jax.sharding`` meshes: tensor, pipeline and data parallel, and multi-host.

* ``mesh``: ``make_mesh`` (the ``("dp", "tp")`` mesh) and ``initialize_distributed`` (multi-host start-up).
* ``head_layout``: ``HeadLayout``, fitting q/kv heads onto tp devices (the head rewrite).
* ``plan``: ``ShardingPlan``, parameter PartitionSpecs, the KV pool's sharding and head-parallel attention under
  ``shard_map``.
* ``pipeline``: pipeline parallelism (contiguous layer stages, the runner's ``PipelineForward``); ``data_parallel``:
  engine replicas behind a prefix-aware router.
* ``multihost``, ``follower``, ``rank_watch``: one engine over several hosts (node 0 schedules, the others run its
  steps' ``SchedulerOutput``s; a dead node ends the job).

The model that runs on a plan, and loading it straight into its shards, live in ``models.tensor_parallel``
(``TensorParallelLlamaForCausalLM``, ``load_sharded_model``, ``shard_model``).
"""

from paged_jax.parallel.head_layout import HeadLayout
from paged_jax.parallel.mesh import (DP_AXIS, ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID, TP_AXIS,
                                     initialize_distributed, make_mesh)
from paged_jax.parallel.plan import KV_LAYOUTS, ShardingPlan

__all__ = ["DP_AXIS", "ENV_COORDINATOR", "ENV_NUM_PROCESSES", "ENV_PROCESS_ID", "HeadLayout", "KV_LAYOUTS",
           "ShardingPlan", "TP_AXIS", "initialize_distributed", "make_mesh"]
