"""Sleep mode: freeing a runner's device memory for a colocated trainer, and taking it back (vLLM's sleep levels).

* ``sleep(level=1)``: the weights are copied to host memory, then their device buffers and the KV pool are deleted.
* ``sleep(level=2)``: the weights and the KV pool are deleted (the caller loads new weights after ``wake_up``).
* ``wake_up(tags)``: ``"weights"`` puts them back in their shardings (level 1: the host copy; level 2: zeros of the
  right shapes, to be overwritten by a weight update), ``"kv_cache"`` allocates a zero KV pool. The step executables
  are unchanged: same shapes, dtypes and shardings, so nothing compiles.

Deleted buffers return to JAX's allocator at once: a trainer in the same process reuses that memory. Another process
gets it back only when JAX's GPU allocator is not a preallocated pool (``XLA_PYTHON_CLIENT_ALLOCATOR=platform``).
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np

logger = logging.getLogger(__name__)

SLEEP_TAGS = ("weights", "kv_cache")


def device_bytes_in_use(device) -> int | None:
    """Bytes JAX's allocator has handed out on ``device`` (None where the platform reports none, e.g. the CPU)."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    return None if not stats else int(stats.get("bytes_in_use", 0))


class RunnerSleep:
    """The sleep state of one ``ModelRunner`` (see the module docstring). ``asleep``: the tags whose memory is
    released; ``weights_discarded``: level 2 dropped them and no weight update has refilled them yet."""

    def __init__(self, runner):
        self.runner = runner
        self.asleep: set[str] = set()
        self.weights_discarded = False
        self._host_weights: list[np.ndarray] | None = None
        self._shardings = [leaf.sharding for leaf in runner.param_leaves]
        self._specs = [(leaf.shape, leaf.dtype) for leaf in runner.param_leaves]

    def sleep(self, level: int) -> None:
        """Release the weights (level 1: to host memory; level 2: dropped) and the KV pool. ValueError naming
        ``level`` for another value; a no-op when already asleep."""
        if level not in (1, 2):
            raise ValueError(f"level must be 1 or 2, got {level!r}")
        runner = self.runner
        if "weights" not in self.asleep:
            leaves = runner.param_leaves
            if level == 1:
                self._host_weights = [np.asarray(x) for x in jax.device_get(leaves)]
            else:
                self._host_weights, self.weights_discarded = None, True
            runner.param_leaves = [None] * len(leaves)
            _delete(leaves)
        if "kv_cache" not in self.asleep and runner.kv_pool_allocated:
            pool, runner.kv_pool = runner.kv_pool, None
            _delete([array for layer in pool for array in layer])
        self.asleep.update(SLEEP_TAGS)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Take back the memory of ``tags`` (default both of ``SLEEP_TAGS``); ValueError naming ``tags`` for an
        unknown one."""
        tags = list(SLEEP_TAGS) if tags is None else list(tags)
        unknown = [tag for tag in tags if tag not in SLEEP_TAGS]
        if unknown:
            raise ValueError(f"tags: unknown tag {unknown[0]!r} (known: {', '.join(SLEEP_TAGS)})")
        runner = self.runner
        if "weights" in tags and "weights" in self.asleep:
            if self._host_weights is not None:
                runner.param_leaves = [jax.device_put(x, s) for x, s in zip(self._host_weights, self._shardings)]
            else:
                runner.param_leaves = [jnp.zeros(shape, dtype, device=sharding)
                                        for (shape, dtype), sharding in zip(self._specs, self._shardings)]
            self._host_weights = None
            self.asleep.discard("weights")
        if "kv_cache" in tags and "kv_cache" in self.asleep:
            jax.block_until_ready(runner.kv_pool)  # allocated (zeros) now rather than at the next step
            self.asleep.discard("kv_cache")


def _delete(arrays) -> None:
    for array in arrays:
        if array is not None and not array.is_deleted():
            array.delete()
