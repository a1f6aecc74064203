"""Names of the ragged paged attention implementations (``paged_jax.ops.ragged_paged_attention``).

They live in this JAX-free module so that configuration (``EngineArgs``, built in the HTTP server's process, which
never imports JAX) and command lines can validate them cheaply; the kernels package imports them from here.
"""

from __future__ import annotations

import warnings

# "triton" and "mosaic" are the two Pallas GPU kernels, by the Pallas backend that lowers them; "reference" is the
# jnp oracle; "auto" picks per static call shape (``choose_impl``).
ATTENTION_IMPLS = ("auto", "reference", "triton", "mosaic")
# Old names still accepted, with a FutureWarning: "pallas" was the Triton kernel's name, though both kernels are Pallas.
DEPRECATED_ATTENTION_IMPLS = {"pallas": "triton"}


def resolve_attention_impl(name: str, field: str = "impl") -> str:
    """The implementation ``name`` stands for: itself if it is one of ``ATTENTION_IMPLS``, the new name of a
    deprecated alias (with a FutureWarning). Raises ValueError starting with ``field`` for anything else."""
    if name in ATTENTION_IMPLS:
        return name
    if name in DEPRECATED_ATTENTION_IMPLS:
        new_name = DEPRECATED_ATTENTION_IMPLS[name]
        warnings.warn(f"{field}={name!r} is deprecated; use {new_name!r} (the same kernel)", FutureWarning,
                      stacklevel=3)
        return new_name
    raise ValueError(f"{field} must be one of {', '.join(ATTENTION_IMPLS)}, got {name!r}")
