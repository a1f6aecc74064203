"""Host cost of dispatching one jitted call on this backend, by argument count and by kernel count (issue 8).

The engine's forward takes every weight and every KV-pool layer as a separate argument and runs a few hundred small
kernels per step; on a GPU both can cost host time per call. This measures, with nothing else running:

* ``args[N]``: a call taking N small arrays (one trivial kernel), dispatch time only (no wait), median.
* ``args_donated[N]``: the same with N/4 of them donated and returned (as the KV pool is).
* ``kernels[K]``: a call on one small array running K dependent small matmuls (separate kernels), dispatch time and
  dispatch + wait.
* ``input_read_by_every_kernel[K]``: K kernels that all read the call's input, dispatch time with the same input
  array every call and with a different one each call (another device address: XLA's command buffer then updates
  every command reading it, as the step's metadata does).

Example: ``python -m benchmarks.dispatch --out $OUT/dispatch.json``; compare runs under different ``XLA_FLAGS``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

import numpy as np

from benchmarks.report import write_json


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--out")
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp

    result = {"benchmark": "dispatch", "device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
              "xla_flags": os.environ.get("XLA_FLAGS", "")}

    def dispatch_ms(fn, fn_args, carry=None):
        """Median host time of fn(*fn_args) without waiting; ``carry`` maps outputs to the next call's args."""
        out = fn(*fn_args)
        jax.block_until_ready(out)
        times = []
        for _ in range(args.repeats):
            if carry is not None:
                fn_args = carry(out, fn_args)
            start = time.perf_counter()
            out = fn(*fn_args)
            times.append(time.perf_counter() - start)
            if len(times) % 20 == 0:
                jax.block_until_ready(out)  # keep the queue short: measure dispatch, not back-pressure
        jax.block_until_ready(out)
        return round(float(np.median(times)) * 1e3, 4)

    key = jax.random.key(0)
    for n in (1, 10, 100, 400):
        xs = [jax.random.normal(jax.random.fold_in(key, i), (8, 128), jnp.bfloat16) for i in range(n)]
        plain = jax.jit(lambda xs: xs[0] * 2)
        result[f"args[{n}]_ms"] = dispatch_ms(plain, (xs,))
        if n >= 4:
            donated = [jax.random.normal(jax.random.fold_in(key, 1000 + i), (8, 128), jnp.bfloat16)
                       for i in range(n // 4)]
            fn = jax.jit(lambda xs, pool: ([p + 1 for p in pool], xs[0] * 2), donate_argnums=(1,))
            result[f"args_donated[{n}+{n // 4}]_ms"] = dispatch_ms(
                fn, (xs, donated), carry=lambda out, a: (a[0], out[0]))

    w = jax.random.normal(key, (64, 64), jnp.bfloat16) * 0.1
    x0 = jax.random.normal(key, (8, 64), jnp.bfloat16)
    for k in (1, 50, 200, 400):
        def chain(x, w, k=k):
            for i in range(k):
                x = jnp.tanh(x @ w + i)  # a matmul + a fusion per iteration: 2 kernels
            return x

        fn = jax.jit(chain)
        result[f"kernels[{2 * k}]_dispatch_ms"] = dispatch_ms(fn, (x0, w))
        jax.block_until_ready(fn(x0, w))
        times = []
        for _ in range(max(args.repeats // 4, 5)):
            start = time.perf_counter()
            jax.block_until_ready(fn(x0, w))
            times.append(time.perf_counter() - start)
        result[f"kernels[{2 * k}]_call_ms"] = round(float(np.median(times)) * 1e3, 4)

    def every_kernel_reads_input(x, w, k=200):
        h = x
        for i in range(k):
            h = jnp.tanh(h @ w + x * i)
        return h

    fn = jax.jit(every_kernel_reads_input)
    inputs = [jax.random.normal(jax.random.fold_in(key, 2000 + i), (8, 64), jnp.bfloat16) for i in range(8)]
    result["input_read_by_every_kernel[400]_same_input_dispatch_ms"] = dispatch_ms(fn, (inputs[0], w))
    turn = itertools.count()
    result["input_read_by_every_kernel[400]_new_input_dispatch_ms"] = dispatch_ms(
        fn, (inputs[0], w), carry=lambda out, a: (inputs[next(turn) % len(inputs)], a[1]))
    print(json.dumps(result), flush=True)
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
