"""What an RL trainer controls in an engine core between rollouts: weight updates, sleep mode, pausing generation.

``RolloutControl`` is held by ``EngineCore`` (its utilities of the same names delegate here, so they work on a core in
this process and, through ``UtilityCall``, on one in its own process):

* ``update_weights(params)`` / ``update_weights_from_disk(path)``: ``paged_jax.worker.weight_update`` (one device,
  tensor or pipeline parallel: into the runner's shards); every update resets the prefix cache (cached blocks hold
  the old weights' KV; running requests keep theirs).
* ``init_weight_transfer_engine(init_info)`` / ``update_weights_from_distributed(names, dtype_names, shapes)``
  (vLLM's names, backend ``"jax"``: needs ``weight_transfer_config``): the weights of a trainer process of the same
  JAX job, through ``paged_jax.parallel.weight_transfer``, then the same update.
* ``sleep(level)`` / ``wake_up(tags)`` / ``is_sleeping()``: ``paged_jax.worker.sleep_mode`` (needs
  ``enable_sleep_mode``); only an idle core sleeps, and requests are refused while it sleeps.
* ``pause_generation(mode)`` / ``resume_generation()``: ``"abort"`` ends every unfinished request (each sequence
  reports ``finish_reason="abort"`` at the next step), ``"wait"`` lets them finish, ``"keep"`` freezes them with
  their KV blocks and continues them at resume. Requests added while paused wait, unscheduled, for the resume.
"""

from __future__ import annotations

import logging

from paged_jax.core.request import Request
from paged_jax.engine.messages import EngineCoreOutput
from paged_jax.parallel.weight_transfer import WeightTransferReceiver
from paged_jax.worker.sleep_mode import RunnerSleep, device_bytes_in_use
from paged_jax.worker.weight_update import WeightUpdater, read_checkpoint

logger = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "wait", "keep")


class RolloutControl:
    """Weight updates, sleep and pause of one ``EngineCore`` (``core``); see the module docstring.

    Args:
      core: the ``EngineCore``.
      quantization: the engine's ``QuantConfig`` or None (re-applied to updated weights).
      enable_sleep_mode: ``EngineArgs.enable_sleep_mode``.
      weight_transfer_config: ``EngineArgs.weight_transfer_config`` (None: no transfers from a trainer process).
    """

    def __init__(self, core, quantization, enable_sleep_mode: bool, weight_transfer_config: dict | None = None):
        self._core = core
        self._weight_transfer_config = weight_transfer_config
        self._receiver: WeightTransferReceiver | None = None
        self._quantization = quantization
        self._updater: WeightUpdater | None = None
        self._sleep = RunnerSleep(core.runner) if enable_sleep_mode else None
        self.pause_mode: str | None = None
        self._held: list[Request] = []  # sequences added while paused, in arrival order
        self._pending: list[EngineCoreOutput] = []  # the aborts of pause_generation("abort"), for the next step

    # ------------------------------------------------------------------ weights
    def update_weights(self, params, *, cast: bool = False) -> None:
        """Replace the weights (``WeightUpdater.update``) and reset the prefix cache."""
        if self._sleep is not None and "weights" in self._sleep.asleep:
            raise ValueError("update_weights: the weights are asleep; call wake_up(tags=['weights']) first")
        updater = self._weight_updater()
        self._core.runner.wait_for_dispatch()  # no step is being handed to the device meanwhile
        updater.update(params, cast=cast)
        if self._sleep is not None:
            self._sleep.weights_discarded = False
        self._core.kv_cache_manager.reset_prefix_cache()

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        """Prepare to receive weights from the trainer process ``init_info["trainer_process"]`` (its
        ``jax.process_index()``); ValueError naming what is missing or wrong."""
        if self._weight_transfer_config is None:
            raise ValueError("init_weight_transfer_engine: start the engine with weight_transfer_config="
                             "{\"backend\": \"jax\"} (--weight-transfer-config)")
        if not isinstance(init_info, dict) or set(init_info) != {"trainer_process"}:
            raise ValueError(f"init_info must be {{\"trainer_process\": <int>}}, got {init_info!r}")
        self._receiver = WeightTransferReceiver(int(init_info["trainer_process"]))

    def update_weights_from_distributed(self, names: list[str], dtype_names: list[str],
                                        shapes: list[list[int]]) -> None:
        """Receive the trainer's next ``send_weights`` (vLLM's update info: each parameter's name, dtype name and
        shape, in the trainer's order) and update from it."""
        if self._receiver is None:
            raise ValueError("update_weights_from_distributed: call init_weight_transfer_engine first")
        if not len(names) == len(dtype_names) == len(shapes):
            raise ValueError("update_info: names, dtype_names and shapes must have one entry per parameter")
        if self._sleep is not None and "weights" in self._sleep.asleep:
            raise ValueError("update_weights_from_distributed: the weights are asleep; call "
                             "wake_up(tags=['weights']) first")
        updater = self._weight_updater()
        self.update_weights(self._receiver.receive(names, dtype_names, shapes, check=updater.check))

    def _weight_updater(self) -> WeightUpdater:
        """The runner's ``WeightUpdater``, made at the first update (ValueError naming a layout it cannot serve)."""
        if self._updater is None:
            self._updater = WeightUpdater(self._core.runner, self._core.model_config, self._quantization)
        return self._updater

    def update_weights_from_disk(self, path: str) -> None:
        """Read an HF safetensors or orbax checkpoint directory (``read_checkpoint``) and update from it (other float
        dtypes are cast to the engine's)."""
        try:
            named = read_checkpoint(path, self._weight_updater())
        except OSError as exc:  # a missing shard, an unreadable file: the caller's path
            raise ValueError(f"update_weights_from_disk: {exc}") from exc
        self.update_weights(named, cast=True)

    # ------------------------------------------------------------------ sleep
    def sleep(self, level: int = 1) -> dict:
        """Release the weights and the KV pool (see ``paged_jax.worker.sleep_mode``). Returns ``{"bytes_in_use_before",
        "bytes_in_use_after"}`` of the runner's device (None on platforms that do not report them)."""
        sleep = self._require_sleep_mode("sleep")
        core = self._core
        if core._groups or core._batch_queue:
            raise ValueError(f"sleep: {len(core._groups)} requests are unfinished; let them finish or "
                             "pause_generation(mode='abort') first")
        device = _first_device(core.runner)
        before = device_bytes_in_use(device)
        sleep.sleep(level)
        core.kv_cache_manager.reset_prefix_cache()  # the pool's contents are gone
        after = device_bytes_in_use(device)
        if before is not None:
            logger.info("sleep(level=%d): device memory in use %.2f GiB -> %.2f GiB", level, before / 2**30,
                        after / 2**30)
        return {"bytes_in_use_before": before, "bytes_in_use_after": after}

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Take back the memory of ``tags`` ("weights", "kv_cache"; default both)."""
        self._require_sleep_mode("wake_up").wake_up(tags)

    def is_sleeping(self) -> bool:
        return self._sleep is not None and bool(self._sleep.asleep)

    def check_can_generate(self) -> None:
        """ValueError when requests cannot run: something asleep, or weights dropped by level 2 not reloaded."""
        if self._sleep is None:
            return
        if self._sleep.asleep:
            raise ValueError(f"the engine is sleeping ({', '.join(sorted(self._sleep.asleep))}); call wake_up() "
                             "first")
        if self._sleep.weights_discarded:
            raise ValueError("the weights were discarded by sleep(level=2); load new ones with update_weights "
                             "first")

    def _require_sleep_mode(self, what: str) -> RunnerSleep:
        if self._sleep is None:
            raise ValueError(f"{what}: sleep mode is not enabled; start the engine with enable_sleep_mode=True "
                             "(--enable-sleep-mode)")
        return self._sleep

    # ------------------------------------------------------------------ pause
    def pause_generation(self, mode: str = "abort") -> None:
        """Stop scheduling new work (see the module docstring); ValueError naming ``mode`` for another value."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        core = self._core
        if mode == "abort":
            for group in list(core._groups.values()):
                indices = list(group.seqs) if group.beam_search is None else [0]
                self._pending += [EngineCoreOutput(group.request_id, index, finish_reason="abort")
                                  for index in indices]
            core.abort_requests(list(core._groups))
        self.pause_mode = mode

    def resume_generation(self) -> None:
        """Schedule again: frozen requests continue, those added while paused are queued (aborted ones dropped)."""
        self.pause_mode = None
        held, self._held = self._held, []
        for request in held:
            if request.request_id in self._core._seq_of:
                self._core.scheduler.add_request(request)

    def is_paused(self) -> bool:
        return self.pause_mode is not None

    def admit(self, request: Request) -> None:
        """Hand a new sequence to the scheduler, or hold it until ``resume_generation`` while paused."""
        if self.pause_mode is None:
            self._core.scheduler.add_request(request)
        else:
            self._held.append(request)

    @property
    def frozen(self) -> bool:
        """Nothing may be scheduled: paused with "keep"."""
        return self.pause_mode == "keep"

    def take_outputs(self) -> list[EngineCoreOutput]:
        outputs, self._pending = self._pending, []
        return outputs

    def has_outputs(self) -> bool:
        return bool(self._pending)


def _first_device(runner):
    leaves = [leaf for leaf in runner.param_leaves if leaf is not None]
    if leaves:
        return next(iter(leaves[0].devices()))
    sharding = runner.input_sharding()
    return next(iter(sharding.device_set))
