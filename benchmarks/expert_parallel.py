"""One sparse MoE layer on a (dp, tp) mesh: the experts split over their width (the default tensor-parallel layout, XLA
partitioning ``lax.ragged_dot``) against expert parallelism (``--enable-expert-parallel``: each device holds
``E / (dp x tp)`` whole experts, ``paged_jax.parallel.expert_parallel``). With ``--dp`` > 1 the tokens are split over
dp (data-parallel attention's layout; token counts dp does not divide are skipped): EP then all-gathers them over dp
and reduce-scatters the sums back.

Shape: Qwen3-30B-A3B's experts by default (hidden 2048, expert width 768, 128 experts, top 8), random bf16 weights and
a random router (``benchmarks.moe_kernel``'s inputs). Per token count T, one JSON line:

* ``tp_us`` / ``ep_us``: median wall microseconds of the layer's experts (sort, grouped matmuls, combine and the
  all-reduce) over ``repeats`` calls after compile and warm-up; ``ep_impl``: the grouped matmul each device ran with
  EP (``--ep-impl``, default "auto": the Pallas kernel on a GPU, as the engine's expert-parallel model runs);
* ``ep_max_abs_diff``: max abs difference of the two outputs (float32 math, bf16 outputs: a few bf16 ulps), with
  ``reference_max_abs``;
* ``max_device_share``: the largest fraction of the step's (token, expert) pairs that one device's experts receive
  (1 / (dp x tp) when balanced).

Usage (GPU, several devices): ``python -m benchmarks.expert_parallel --tp 4 [--dp 2] --out ep.json``; on the CPU with
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` and tiny shapes (the smoke test).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from benchmarks.moe_kernel import DEFAULT_TOKENS, _inputs  # (its import registers the kernel, moe_impl "auto")
from benchmarks.report import median_seconds
from models.moe import MOE_IMPLS, moe_experts_reference, resolve_moe_impl
from paged_jax.parallel import DP_AXIS, TP_AXIS, make_mesh
from paged_jax.parallel.expert_parallel import ExpertParallel, expert_axes


def _placed(inputs: dict, mesh, expert_parallel: bool) -> dict:
    """The layer's inputs on ``mesh``: tokens and routing split over dp, experts split over E (EP, over dp x tp) or
    over I (tp)."""
    if expert_parallel:
        whole = P(expert_axes(mesh.shape[DP_AXIS]), None, None)
        specs = dict(w_gate=whole, w_up=whole, w_down=whole)
    else:
        specs = dict(w_gate=P(None, None, TP_AXIS), w_up=P(None, None, TP_AXIS), w_down=P(None, TP_AXIS, None))
    return {name: jax.device_put(value, NamedSharding(mesh, specs.get(name, P(DP_AXIS)))) for name, value in
            inputs.items()}


def run_one(num_tokens: int, mesh, args) -> dict:
    """One token count: both layouts timed and compared."""
    inputs = _inputs(num_tokens, args.hidden, args.inter, args.experts, args.top_k, args.seed)
    dp, tp_size = mesh.shape[DP_AXIS], mesh.shape[TP_AXIS]
    tokens_out = NamedSharding(mesh, P(DP_AXIS))
    layer = ExpertParallel(mesh, expert_axes(dp), token_axis=DP_AXIS if dp > 1 else None)
    tensor_parallel = jax.jit(moe_experts_reference, out_shardings=tokens_out)
    expert_parallel = jax.jit(lambda *a: layer(*a, impl=args.ep_impl), out_shardings=tokens_out)
    order = ("x", "w_gate", "w_up", "w_down", "topk_weights", "topk_ids")
    tp_args = [_placed(inputs, mesh, False)[name] for name in order]
    ep_args = [_placed(inputs, mesh, True)[name] for name in order]
    tp_out = np.asarray(tensor_parallel(*tp_args), np.float32)
    ep_out = np.asarray(expert_parallel(*ep_args), np.float32)
    share = np.bincount(np.asarray(inputs["topk_ids"]).reshape(-1) // (args.experts // layer.size),
                        minlength=layer.size)
    ep_impl = resolve_moe_impl(args.ep_impl, num_tokens * args.top_k, args.hidden, inputs["x"].dtype)
    return {"tokens": num_tokens, "dp": dp, "tp": tp_size, "ep_impl": ep_impl,
            "tp_us": 1e6 * median_seconds(lambda: tensor_parallel(*tp_args), args.repeats),
            "ep_us": 1e6 * median_seconds(lambda: expert_parallel(*ep_args), args.repeats),
            "ep_max_abs_diff": float(np.abs(ep_out - tp_out).max()), "reference_max_abs": float(np.abs(tp_out).max()),
            "max_device_share": float(share.max() / share.sum())}


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=None, help="default: every device over --dp")
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--tokens", default=DEFAULT_TOKENS)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--inter", type=int, default=768)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ep-impl", default="auto", choices=MOE_IMPLS)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    mesh = make_mesh(args.tp or len(jax.devices()) // args.dp, args.dp)
    results = []
    for num_tokens in (int(t) for t in args.tokens.split(",") if int(t) % args.dp == 0):
        result = run_one(num_tokens, mesh, args)
        print(json.dumps(result), flush=True)
        results.append(result)
    if args.out is not None:
        args.out.write_text("".join(json.dumps(r) + "\n" for r in results))
    return results


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
