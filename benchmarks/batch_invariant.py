"""The batch-invariant matmul (``paged_jax.ops.batch_invariant``) against XLA's dot on a model's projection shapes.

    python -m benchmarks.batch_invariant [--preset llama-3.1-8b] [--rows 1,16,256,2048] [--repeats 20] [--out F]

Per projection (K, N) of the preset (fused qkv, o, fused gate/up, down, LM head) and row count M, one JSON line:
whether row 0 of ``x[:M] @ w`` is the same bits as row 0 of ``x[:1] @ w`` for XLA's dot (``xla_row0_same``) and for
the batch-invariant matmul (``invariant_row0_same``, which must be true), the latter's largest difference from a
float32 reference relative to XLA's, and the median wall time of each (``repeats`` calls after a warm-up,
``block_until_ready``). ``--tiny`` runs the CPU smoke shapes (the "tiles" path, or the Pallas kernel in interpret
mode with ``--impl pallas``).
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.report import median_seconds, versions, write_json
from models.presets import preset_config
from paged_jax.ops.batch_invariant import batch_invariant_matmul, resolve_impl

TINY_SHAPES = [("qkv", 64, 96), ("lm_head", 64, 200)]


def projection_shapes(preset: str) -> list[tuple[str, int, int]]:
    """(name, K, N) of the preset's matmuls over the token dimension (the engine fuses qkv and gate/up)."""
    c = preset_config(preset)
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    return [("qkv", c.hidden_size, q + 2 * kv), ("o", q, c.hidden_size), ("gate_up", c.hidden_size,
            2 * c.intermediate_size), ("down", c.intermediate_size, c.hidden_size),
            ("lm_head", c.hidden_size, c.vocab_size)]


def run_case(name: str, k: int, n: int, rows: int, *, impl: str, repeats: int, interpret: bool) -> dict:
    """One (shape, M) line (module docstring)."""
    keys = jax.random.split(jax.random.key(k * 7919 + n), 2)
    x = jax.random.normal(keys[0], (rows, k), jnp.float32).astype(jnp.bfloat16)
    w = (0.02 * jax.random.normal(keys[1], (k, n), jnp.float32)).astype(jnp.bfloat16)
    xla = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
    inv = jax.jit(lambda a, b: batch_invariant_matmul(a, b, impl=impl, interpret=interpret))
    reference = np.asarray(jnp.dot(x[:1].astype(jnp.float32), w.astype(jnp.float32), precision="highest"))[0]
    one_xla, one_inv = (np.asarray(f(x[:1], w)[0].astype(jnp.float32)) for f in (xla, inv))
    many_xla, many_inv = (np.asarray(f(x, w)[0].astype(jnp.float32)) for f in (xla, inv))
    xla_err = float(np.abs(one_xla - reference).max())
    return {"shape": name, "K": k, "N": n, "M": rows, "impl": resolve_impl(impl),
            "xla_row0_same": bool((one_xla == many_xla).all()),
            "invariant_row0_same": bool((one_inv == many_inv).all()),
            "invariant_err_over_xla_err": float(np.abs(one_inv - reference).max()) / max(xla_err, 1e-30),
            "xla_ms": 1e3 * median_seconds(lambda: xla(x, w), repeats),
            "invariant_ms": 1e3 * median_seconds(lambda: inv(x, w), repeats)}


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="llama-3.1-8b")
    p.add_argument("--rows", default="1,16,256,2048", help="comma-separated row counts M")
    p.add_argument("--impl", default="auto", help="auto | pallas | tiles")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--tiny", action="store_true", help="CPU smoke shapes")
    p.add_argument("--out", help="write the lines as JSON here")
    args = p.parse_args(argv)
    shapes = TINY_SHAPES if args.tiny else projection_shapes(args.preset)
    interpret = jax.default_backend() != "gpu"
    results = []
    for name, k, n in shapes:
        for rows in (int(r) for r in args.rows.split(",")):
            line = run_case(name, k, n, rows, impl=args.impl, repeats=args.repeats, interpret=interpret)
            print(json.dumps(line), flush=True)
            results.append(line)
    write_json(args.out, {"versions": versions(), "cases": results})
    return results


if __name__ == "__main__":
    main()
