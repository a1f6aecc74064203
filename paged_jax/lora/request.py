"""``LoRARequest``: which LoRA adapter a request runs with (vLLM's class, fields and meaning)."""

from __future__ import annotations

import dataclasses
import hashlib


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """A PEFT LoRA adapter to apply to one request.

    Attributes:
      lora_name: a human-readable name (the server's ``model`` name of the adapter).
      lora_int_id: a globally unique id >= 1; requests with the same id share one loaded adapter (the engine
        caches adapters by it), so a different adapter needs a different id.
      lora_path: the adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``).
      base_model_name: the served base model this adapter belongs to (``/v1/models`` lists it as ``parent``).
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_request: lora_name must be a non-empty str, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_request: lora_int_id must be an int >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_request: lora_path must name the adapter directory, got {self.lora_path!r}")

    # vLLM's short names.
    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

    @property
    def cache_key(self) -> bytes:
        """Seeds the prefix-cache hash chain of the request's blocks: K/V computed under one adapter is never a hit
        for another adapter (nor for the base model, whose chain starts from ``b""``)."""
        return hashlib.sha256(f"lora\0{self.lora_int_id}\0{self.lora_name}\0{self.lora_path}".encode()).digest()
