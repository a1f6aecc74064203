"""``PoolingParams``: what a pooling request asks of the pooled vector (vLLM's names and defaults)."""

from __future__ import annotations

from dataclasses import dataclass

POOLING_TASKS = ("embed", "classify", "score")


@dataclass
class PoolingParams:
    """Parameters of one pooling request (vLLM's ``PoolingParams``).

    Fields:
      dimensions: Matryoshka truncation of an embedding to its first ``dimensions`` values (then normalized); only
        for a model whose pooler supports it (``PoolerConfig.supports_dimensions``).
      normalize: L2-normalize an embedding; None: the model's pooler default.
      activation: apply the classifier's activation (softmax over several labels, sigmoid over one); None: True.
      truncate_prompt_tokens: keep the last k prompt tokens (k >= 1), as the generate endpoints do.
      task: "embed", "classify" or "score" (set by the entry point; checked against the model's pooler).
    """

    dimensions: int | None = None
    normalize: bool | None = None
    activation: bool | None = None
    truncate_prompt_tokens: int | None = None
    task: str | None = None

    def __post_init__(self) -> None:
        for name in ("dimensions", "truncate_prompt_tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        for name in ("normalize", "activation"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"{name} must be a bool, got {value!r}")
        if self.task is not None and self.task not in POOLING_TASKS:
            raise ValueError(f"task must be one of {', '.join(POOLING_TASKS)}, got {self.task!r}")
