"""``LoRAManager``: the engine's adapters: an LRU of adapters in host memory (``max_cpu_loras``) and the assignment
of device slots (``max_loras``, least recently used slot evicted) for each step.

An adapter is read (``paged_jax.lora.peft``) and checked when it is first named (``add_lora`` or a request's
``lora_request``), so a bad adapter is refused there with a ValueError and never reaches a step. A request holds
its ``LoadedLoRA`` until it ends, so an adapter evicted from the host LRU (or removed) while requests still use it
stays available to them. Per step ``slots_for_step`` returns each adapter's slot, writing the ones not resident
into slots no adapter of this step uses (``LoRASlots.write``, in place: no recompile); the scheduler admits at most
``max_loras`` distinct adapters into the running batch, so a step never needs more slots than there are.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Iterable

from paged_jax.lora.peft import load_peft_adapter
from paged_jax.lora.request import LoRARequest
from paged_jax.lora.slots import LoadedLoRA, LoRASlots

logger = logging.getLogger(__name__)


class LoRAManager:
    """Adapters of one engine.

    Args:
      slots: the runner's ``LoRASlots`` (shapes, slot form).
      write_slot: ``write_slot(slot, loaded)``: puts an adapter into a device slot (``ModelRunner.write_lora_slot``:
        ordered with the steps already dispatched).
      max_loras / max_lora_rank / max_cpu_loras: the engine arguments.
    """

    def __init__(self, slots: LoRASlots, write_slot: Callable[[int, LoadedLoRA], None], *, max_loras: int,
                 max_lora_rank: int, max_cpu_loras: int):
        self.slots = slots
        self._write_slot = write_slot
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max_cpu_loras
        self._cpu: collections.OrderedDict[int, LoadedLoRA] = collections.OrderedDict()  # LRU, oldest first
        self._slot_owner: dict[int, LoadedLoRA | None] = {slot: None for slot in range(1, max_loras + 1)}
        self._slot_lru: collections.OrderedDict[int, None] = collections.OrderedDict(
            (slot, None) for slot in range(1, max_loras + 1))
        self.num_slot_writes = 0

    # ------------------------------------------------------------------ host cache
    def get(self, lora_request: LoRARequest) -> LoadedLoRA:
        """The adapter of ``lora_request``, read and checked on first use (ValueError starting with
        ``lora_request``); an adapter id already known under another name or path is refused."""
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")
        loaded = self._cpu.get(lora_request.lora_int_id)
        if loaded is None:
            loaded = next((owner for owner in self._slot_owner.values()
                           if owner is not None and owner.lora_int_id == lora_request.lora_int_id), None)
        if loaded is not None:
            known = loaded.lora_request
            if (known.lora_name, known.lora_path) != (lora_request.lora_name, lora_request.lora_path):
                raise ValueError(f"lora_request: lora_int_id {lora_request.lora_int_id} already names adapter "
                                 f"{known.lora_name!r} at {known.lora_path!r}; give a different adapter its own id")
        else:
            adapter = load_peft_adapter(lora_request, self.slots.checkpoint_config, self.max_lora_rank)
            loaded = self.slots.to_slot_form(adapter, lora_request)
            logger.info("LoRA adapter %r (id %d, rank %d) loaded from %s", lora_request.lora_name,
                        lora_request.lora_int_id, adapter.rank, lora_request.lora_path)
        self._cpu[lora_request.lora_int_id] = loaded
        self._cpu.move_to_end(lora_request.lora_int_id)
        while len(self._cpu) > self.max_cpu_loras:
            self._cpu.popitem(last=False)
        return loaded

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """vLLM's ``add_lora``: load the adapter into host memory ahead of requests. True if it was not there."""
        new = lora_request.lora_int_id not in self._cpu
        self.get(lora_request)
        return new

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter (host cache and device slot); requests already using it keep their copy. True if it
        was known."""
        known = self._cpu.pop(lora_int_id, None) is not None
        for slot, owner in self._slot_owner.items():
            if owner is not None and owner.lora_int_id == lora_int_id:
                self._slot_owner[slot] = None
                self._slot_lru.move_to_end(slot, last=False)  # reused first
                known = True
        return known

    def list_loras(self) -> set[int]:
        return set(self._cpu)

    # ------------------------------------------------------------------ device slots
    def slots_for_step(self, adapters: Iterable[LoadedLoRA]) -> dict[int, int]:
        """``{lora_int_id: slot}`` for the distinct adapters of one step, writing those not resident into the least
        recently used slots that this step does not use. Raises RuntimeError for more adapters than slots (the
        scheduler never builds such a step)."""
        wanted = {loaded.lora_int_id: loaded for loaded in adapters}
        if len(wanted) > self.max_loras:
            raise RuntimeError(f"a step with {len(wanted)} LoRA adapters, more than max_loras={self.max_loras}")
        slot_of = {}
        for slot, owner in self._slot_owner.items():
            if owner is not None and wanted.get(owner.lora_int_id) is owner:
                slot_of[owner.lora_int_id] = slot
        for lora_int_id, loaded in wanted.items():
            if lora_int_id not in slot_of:
                slot = next(s for s in self._slot_lru if s not in slot_of.values())
                self._write_slot(slot, loaded)
                self.num_slot_writes += 1
                self._slot_owner[slot] = loaded
                slot_of[lora_int_id] = slot
            self._slot_lru.move_to_end(slot_of[lora_int_id])
        return slot_of
