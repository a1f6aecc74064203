"""The working state of one ``Scheduler.schedule()`` call (``paged_jax.core.scheduler``): the step's plan and the
admission pass's tallies."""

from __future__ import annotations

import dataclasses

from paged_jax.core.request import Request


@dataclasses.dataclass
class StepPlan:
    """One ``schedule()`` call's working state: the budget left, the planned ``request_id -> (request, new
    tokens)``, what it preempted and the swap copies it queued."""

    budget: int
    seats: int  # most requests running at once (``Scheduler.ready_limits``)
    planned: dict[str, tuple[Request, int]] = dataclasses.field(default_factory=dict)
    preempted: list[str] = dataclasses.field(default_factory=list)
    swap_out: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    swap_in: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    long_prefills: list[Request] = dataclasses.field(default_factory=list)  # running, left for after admissions
    short_prefill_started: bool = False  # a short prompt gets its first tokens: long prefills are capped


PASSED_OVER = 0  # ``Scheduler._admit``: a long prompt left waiting for the shorter ones behind it


@dataclasses.dataclass
class Admission:
    """``Scheduler._schedule_waiting``'s running tallies: requests passed over (adapter slots full, or a long prompt
    left for shorter ones), the adapters in the running batch, seats reserved for forks, long partial prefills."""

    running_loras: set[int]
    reserved: int
    num_partial_long: int
    passed_over: set[str] = dataclasses.field(default_factory=set)
