"""Errors of the engine as a service: a core that stopped, a full waiting queue."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine loop has stopped (a step failed or the engine was shut down); no request can be served."""


class EngineProcessDied(EngineDeadError):
    """The engine core's process exited or stopped answering."""


class EngineOverloadedError(RuntimeError):
    """The bounded waiting queue is full; retry after ``retry_after_s`` seconds."""

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


def waiting_bound_error(num_waiting: int, num_seqs: int, max_waiting_requests: int) -> EngineOverloadedError | None:
    """The error refusing a group of ``num_seqs`` sequences while ``num_waiting`` wait, if that passes the bound."""
    if num_waiting + num_seqs <= max_waiting_requests:
        return None
    return EngineOverloadedError(f"the waiting queue is full ({num_waiting} waiting, at most {max_waiting_requests}); "
                                 "retry later")
