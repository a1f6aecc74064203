"""Multi-LoRA serving: ``LoRARequest`` (request.py), PEFT adapter reading and checks (peft.py), the batched
low-rank update inside the jitted step (layers.py), the device slots (slots.py) and the engine's adapter cache and
slot assignment (manager.py)."""

from paged_jax.lora.request import LoRARequest

__all__ = ["LoRARequest"]
