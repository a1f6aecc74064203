"""A named set of implementations of one model op (the jnp reference ``"xla"`` and kernels that ``paged_jax.ops``
registers when imported), with the ``"auto"`` selector that picks one from static shapes, so ``models`` never imports
``paged_jax``."""

from __future__ import annotations

from typing import Callable


class ImplRegistry:
    """Implementations of one op by name.

    Args:
      field: the option's name in error messages (e.g. "rms_norm_impl").
      names: the accepted names, "auto" first (e.g. ``("auto", "xla", "pallas")``).
    """

    def __init__(self, field: str, names: tuple[str, ...]):
        self.field = field
        self.names = names
        self._impls: dict[str, Callable] = {}
        self._selector: Callable[..., str] | None = None

    def register(self, name: str, fn: Callable) -> None:
        """Make ``fn`` the implementation ``name`` (any of ``names`` but "auto")."""
        if name not in self.names or name == "auto":
            raise ValueError(f"{self.field} implementation name must be one of {self.names[1:]}, got {name!r}")
        self._impls[name] = fn

    def register_selector(self, fn: Callable[..., str]) -> None:
        """``fn(*static_shape_args) -> name`` decides "auto" (no recompile at run time)."""
        self._selector = fn

    def check(self, impl: str) -> str:
        """``impl`` itself, or a ValueError naming the field."""
        if impl not in self.names:
            raise ValueError(f"{self.field} must be one of {', '.join(self.names)}, got {impl!r}")
        return impl

    def resolve(self, impl: str, *shape_args) -> str:
        """The implementation ``impl`` runs for the static ``shape_args`` (the selector's arguments); "auto"
        without a registered selector is "xla"."""
        self.check(impl)
        if impl == "auto":
            impl = self._selector(*shape_args) if self._selector is not None else "xla"
        if impl not in self._impls:
            raise ValueError(f"{self.field} {impl!r} is not available: import paged_jax.ops to register it")
        return impl

    def __getitem__(self, name: str) -> Callable:
        return self._impls[name]
