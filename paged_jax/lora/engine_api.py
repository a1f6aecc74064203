"""The LoRA parts an engine core is built with: the runner's device slots and the adapter manager over them (both None
unless ``enable_lora``); ``EngineCore`` holds the manager and serves ``add_lora`` / ``remove_lora`` / ``list_loras``."""

from __future__ import annotations

from paged_jax.lora.manager import LoRAManager
from paged_jax.lora.slots import LoRASlots


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
