"""The engine's LoRA surface (vLLM's ``LLMEngine.add_lora / remove_lora / list_loras``) and its set-up, kept with
the LoRA concept; ``LLMEngine`` mixes ``LoRAEngineMixin`` in and holds ``lora_manager`` (None unless
``enable_lora``)."""

from __future__ import annotations

from paged_jax.lora.manager import LoRAManager
from paged_jax.lora.request import LoRARequest
from paged_jax.lora.slots import LoadedLoRA, LoRASlots


def make_lora_slots(engine_args, model, run_config, plan, device) -> LoRASlots | None:
    """The device slots of an engine with ``enable_lora`` (None without): the model's projection layout (fused on
    one device, HF layout split over tp), its dtype, its mesh."""
    if not engine_args.enable_lora:
        return None
    fused = model.model.layers[0].self_attn.qkv_proj is not None
    return LoRASlots(run_config, fused=fused, max_loras=engine_args.max_loras,
                     max_lora_rank=engine_args.max_lora_rank, dtype=model.dtype, device=device, sharding_plan=plan)


def make_lora_manager(engine_args, runner) -> LoRAManager | None:
    """The adapter cache over the runner's device slots (``runner.lora_slots``; None without ``enable_lora``)."""
    slots = runner.lora_slots
    if slots is None:
        return None
    return LoRAManager(slots, runner.write_lora_slot, max_loras=engine_args.max_loras,
                       max_lora_rank=engine_args.max_lora_rank,
                       max_cpu_loras=engine_args.max_cpu_loras or engine_args.max_loras)


class LoRAEngineMixin:
    """``add_lora`` / ``remove_lora`` / ``list_loras`` and the per-request adapter lookup of ``LLMEngine``."""

    lora_manager: LoRAManager | None

    def _require_lora(self, field: str = "lora_request") -> LoRAManager:
        if self.lora_manager is None:
            raise ValueError(f"{field}: LoRA is not enabled; start the engine with enable_lora=True (--enable-lora)")
        return self.lora_manager

    def resolve_lora(self, lora_request: LoRARequest | None, beam_search: bool = False) -> LoadedLoRA | None:
        """The adapter a new request runs with (read and checked now; ValueError naming ``lora_request``). Beam
        search (``beam_search=True``) forks its beams outside the adapter plumbing, so it is refused with one."""
        if lora_request is not None and beam_search:
            raise ValueError("lora_request is not supported with beam search (BeamSearchParams)")
        return None if lora_request is None else self._require_lora().get(lora_request)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter into host memory ahead of its requests (ValueError if it cannot be served). True if it
        was not loaded yet."""
        return self._require_lora().add_lora(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        """Forget adapter ``lora_id`` (requests already using it finish with it). True if it was loaded."""
        return self._require_lora("lora_id").remove_lora(lora_id)

    def list_loras(self) -> set[int]:
        """Ids of the adapters in host memory."""
        return self._require_lora().list_loras() if self.lora_manager is not None else set()

    def lora_slots_for_step(self, requests) -> dict[int, int]:
        """``{lora_int_id: device slot}`` for the adapters of a step's requests (``{}`` without LoRA)."""
        if self.lora_manager is None:
            return {}
        return self.lora_manager.slots_for_step(r.lora for r in requests if r.lora is not None)
