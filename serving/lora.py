"""LoRA adapters in the server (vLLM's interface): ``--lora-modules`` (static adapters, loaded at start-up), the
registry of served adapters (a request's ``model`` names one; ``/v1/models`` lists them with their ``parent``), and
loading / unloading at run time (``POST /v1/load_lora_adapter`` / ``/v1/unload_lora_adapter``, mounted only when
``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` is true, as in vLLM; ``serving.routes.lora``).

The engine reads and checks an adapter when it is added (``LLMEngine.add_lora``, on the engine thread through
``AsyncEngine.call``), so a bad adapter is answered 400 (404 when there is none at the path) and never served.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import logging
import os
from typing import Any

from paged_jax.lora.request import LoRARequest
from serving.errors import APIError

logger = logging.getLogger(__name__)

RUNTIME_UPDATING_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_lora_updating_allowed() -> bool:
    """vLLM's switch for the load / unload routes: the environment variable set to true (or 1)."""
    return os.environ.get(RUNTIME_UPDATING_ENV, "").strip().lower() in ("1", "true")


@dataclasses.dataclass(frozen=True)
class LoRAModulePath:
    """One ``--lora-modules`` entry (vLLM's): the served name, the adapter directory, optionally the base model."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(text: str) -> LoRAModulePath:
    """argparse type of ``--lora-modules``: ``name=path`` or vLLM's JSON form
    ``{"name": ..., "path": ..., "base_model_name": ...}``."""
    if text.lstrip().startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"--lora-modules: invalid JSON {text!r} ({exc})")
        if not isinstance(value, dict) or not value.get("name") or not value.get("path") \
                or set(value) - {"name", "path", "base_model_name"}:
            raise argparse.ArgumentTypeError(f"--lora-modules: the JSON form takes name, path and optionally "
                                             f"base_model_name, got {text!r}")
        return LoRAModulePath(str(value["name"]), str(value["path"]), value.get("base_model_name"))
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--lora-modules takes name=path or a JSON object, got {text!r}")
    return LoRAModulePath(name, path)


class LoRARegistry:
    """The adapters the server serves, by name (each with a server-assigned ``lora_int_id``, as vLLM)."""

    def __init__(self, base_model_names: tuple[str, ...]):
        self.base_model_names = base_model_names
        self._by_name: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)

    def get(self, name: str | None) -> LoRARequest | None:
        return self._by_name.get(name) if name is not None else None

    def __iter__(self):
        return iter(list(self._by_name.values()))

    def new_request(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        base = base_model_name if base_model_name in self.base_model_names else None
        return LoRARequest(lora_name=name, lora_int_id=next(self._ids), lora_path=path, base_model_name=base)

    def add_static(self, engine: Any, modules: list[LoRAModulePath]) -> None:
        """Load ``--lora-modules`` at start-up, before the engine thread runs (ValueError naming the adapter)."""
        for module in modules:
            if module.name in self._by_name or module.name in self.base_model_names:
                raise ValueError(f"--lora-modules: the name {module.name!r} is used twice")
            lora_request = self.new_request(module.name, module.path, module.base_model_name)
            if not hasattr(engine, "add_lora"):
                raise ValueError("--lora-modules: this engine has no LoRA support")
            engine.add_lora(lora_request)
            self._by_name[module.name] = lora_request
            logger.info("Loaded LoRA adapter %r from %s", module.name, module.path)

    async def load(self, async_engine: Any, name: str, path: str, load_inplace: bool = False) -> str:
        """``/v1/load_lora_adapter``: vLLM's checks and answers (APIError 400 / 404)."""
        if not name or not path:
            raise APIError(400, "Both 'lora_name' and 'lora_path' must be provided.")
        old = self._by_name.get(name)
        if (old is not None and not load_inplace) or name in self.base_model_names:
            raise APIError(400, f"The lora adapter '{name}' has already been loaded.")
        lora_request = self.new_request(name, path)
        try:
            await async_engine.call("add_lora", lora_request)
        except ValueError as exc:
            message = str(exc)
            if "No adapter found" in message:
                raise APIError(404, message) from exc
            raise APIError(400, message) from exc
        self._by_name[name] = lora_request
        if old is not None:  # load_inplace: the new weights serve from now on, the old adapter is dropped
            await async_engine.call("remove_lora", old.lora_int_id)
        logger.info("Loaded new LoRA adapter: name %r, path %r", name, path)
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload(self, async_engine: Any, name: str, lora_int_id: int | None = None) -> str:
        """``/v1/unload_lora_adapter``: 404 for an unknown name; requests already running finish with it."""
        if not name and not lora_int_id:
            raise APIError(400, "either 'lora_name' and 'lora_int_id' needs to be provided.")
        lora_request = self._by_name.get(name)
        if lora_request is None or (lora_int_id is not None and lora_int_id != lora_request.lora_int_id):
            raise APIError(404, f"The lora adapter '{name}' cannot be found.")
        del self._by_name[name]
        await async_engine.call("remove_lora", lora_request.lora_int_id)
        logger.info("Removed LoRA adapter: name %r", name)
        return f"Success: LoRA adapter '{name}' removed successfully."
