"""Batch-invariant mode (``--batch-invariant``): is it bit-exact on this device, and what does it cost?

    python -m benchmarks.batch_invariant [--sections matmul,invariance,engine] [--out F]

Sections, each printing JSON lines:

* ``matmul``: per projection (K, N) of ``--preset`` (fused qkv, o, fused gate/up, down, LM head) and row count M
  (``--rows``), for XLA's dot and each of ``--impls`` (``paged_jax.ops.batch_invariant``): whether row 0 keeps its
  bits in ``x[:M]`` and when moved to the last row of another batch (``*_row0_same``, ``*_moved_same``; the mode's
  must be true), its largest difference from a float32 reference over XLA's, and the median time (``--repeats``);
  ``pallas:BNxBKxS`` runs the kernel with S K splits (``auto``: the shape's rule), ``*_split_k`` the splits run.
* ``invariance``: an engine in the mode (``--invariance-shape``, dummy weights, ``--dtype``): a target prompt longer
  than a step (chunked prefill) decoded greedily and seeded, alone and among ``--crowds`` other requests of other
  lengths and sampling settings, prefix cache reset between runs; ``same_bits`` per crowd (tokens and every
  logprob); then ``generate(batch_invariant=True)`` (the target among other prompts) against the engine's greedy
  run and ``score_tokens(batch_invariant=True)`` (the target's completions among other rows) against both runs.
* ``engine``: ``benchmarks.throughput`` in a subprocess per workload (``--workloads``: ``nano`` = the nano-vllm
  bench's command, ``batch1-8b`` = batch-1 Llama-3.1-8B 128 in / 128 out, greedy) without and with
  ``--batch-invariant``: output tok/s of each and ``cost_ratio`` (normal / invariant tok/s). Extra throughput
  arguments after ``--`` go to every run (``--tiny-model DIR`` replaces the workloads with a CPU smoke run).

``--tiny`` runs the CPU smoke settings (small matmul shapes, a tiny random checkpoint written to a temporary
directory for the other sections).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.report import median_seconds, versions, write_json
from models.presets import preset_config
from paged_jax.ops.batch_invariant import (BLOCK_K, batch_invariant_matmul, matmul_pallas, resolve_split_k,
                                           split_steps)

TINY_SHAPES = [("qkv", 64, 96), ("lm_head", 64, 200)]
ENGINE_WORKLOADS = {
    "nano": ["--shape", "qwen3-0.6b", "--workload", "nano-vllm", "--max-num-batched-tokens", "2048",
             "--max-model-len", "4096", "--async-scheduling"],
    "batch1-8b": ["--shape", "llama-3.1-8b", "--workload", "random", "--num-prompts", "1", "--input-len", "128",
                  "--output-len", "128", "--temperature", "0", "--max-model-len", "4096", "--async-scheduling"],
}


def projection_shapes(preset: str) -> list[tuple[str, int, int]]:
    """(name, K, N) of the preset's matmuls over the token dimension (the engine fuses qkv and gate/up)."""
    c = preset_config(preset)
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    return [("qkv", c.hidden_size, q + 2 * kv), ("o", q, c.hidden_size), ("gate_up", c.hidden_size,
            2 * c.intermediate_size), ("down", c.intermediate_size, c.hidden_size),
            ("lm_head", c.hidden_size, c.vocab_size)]


def _pallas_spec(impl: str) -> tuple[int | None, int, str | None]:
    """(block_n, block_k, split_k) of a ``pallas`` or ``pallas:BNxBK[xS]`` impl (None: the kernel's default)."""
    if impl == "pallas":
        return None, BLOCK_K, None
    parts = impl.split(":")[1].split("x")
    if len(parts) not in (2, 3) or not all(p.isdigit() for p in parts[:2]):
        raise ValueError(f"--impls: {impl!r} is not pallas:BNxBK or pallas:BNxBKxS")
    split_k = parts[2] if len(parts) == 3 else None
    resolve_split_k(split_k, int(parts[1]), int(parts[0]))  # a bad S is refused before any timing
    return int(parts[0]), int(parts[1]), split_k


def _matmul_fn(impl: str, interpret: bool):
    """``x, w -> x @ w`` by ``impl``: one of ``MATMUL_IMPLS``, or ``pallas:BNxBK[xS]`` for the kernel with other
    column and K tiles and ``S`` K splits (an int, or ``auto``: ``split_k_for``; none given: the kernel's default)."""
    if impl.startswith("pallas:"):
        block_n, block_k, split_k = _pallas_spec(impl)
        return lambda a, b: matmul_pallas(a, b, interpret=interpret, block_n=block_n, block_k=block_k,
                                          split_k=split_k)
    return lambda a, b: batch_invariant_matmul(a, b, impl=impl, interpret=interpret)


def _split_k_run(impl: str, k: int, n: int) -> int:
    """The K splits the Pallas ``impl`` runs for a ``[K, N]`` weight."""
    block_n, block_k, split_k = _pallas_spec(impl)
    return split_steps(k, block_k, resolve_split_k(split_k, k, n, block_n=block_n, block_k=block_k))[0]


def run_case(name: str, k: int, n: int, rows: int, *, impls: list[str], repeats: int, interpret: bool) -> dict:
    """One (shape, M) line (module docstring)."""
    keys = jax.random.split(jax.random.key(k * 7919 + n), 3)
    x = jax.random.normal(keys[0], (rows, k), jnp.float32).astype(jnp.bfloat16)
    w = (0.02 * jax.random.normal(keys[1], (k, n), jnp.float32)).astype(jnp.bfloat16)
    # Row 0 of x as the last row of a batch of other rows.
    moved = jax.random.normal(keys[2], (rows, k), jnp.float32).astype(jnp.bfloat16).at[rows - 1].set(x[0])
    fns = {"xla": jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(jnp.bfloat16))}
    for impl in impls:
        fns[impl] = jax.jit(_matmul_fn(impl, interpret))
    reference = np.asarray(jnp.dot(x[:1].astype(jnp.float32), w.astype(jnp.float32), precision="highest"))[0]
    line: dict = {"shape": name, "K": k, "N": n, "M": rows}
    for impl, fn in fns.items():
        one = np.asarray(fn(x[:1], w)[0].astype(jnp.float32))
        line[f"{impl}_row0_same"] = bool((one == np.asarray(fn(x, w)[0].astype(jnp.float32))).all())
        line[f"{impl}_moved_same"] = bool((one == np.asarray(fn(moved, w)[rows - 1].astype(jnp.float32))).all())
        line[f"{impl}_err"] = float(np.abs(one - reference).max())
        line[f"{impl}_ms"] = 1e3 * median_seconds(lambda fn=fn: fn(x, w), repeats)
    for impl in impls:
        if impl.startswith("pallas"):
            line[f"{impl}_split_k"] = _split_k_run(impl, k, n)
        line[f"{impl}_err_over_xla_err"] = line[f"{impl}_err"] / max(line["xla_err"], 1e-30)
        line[f"{impl}_over_xla_time"] = line[f"{impl}_ms"] / line["xla_ms"]
    return line


def matmul_section(args) -> list[dict]:
    shapes = TINY_SHAPES if args.tiny else projection_shapes(args.preset)
    interpret = jax.default_backend() != "gpu"
    lines = []
    for name, k, n in shapes:
        for rows in (int(r) for r in args.rows.split(",")):
            lines.append(run_case(name, k, n, rows, impls=args.impls.split(","), repeats=args.repeats,
                                  interpret=interpret))
            print(json.dumps(lines[-1]), flush=True)
    return lines


def _prompt(rng, length: int, vocab: int) -> list[int]:
    return [int(t) for t in rng.integers(3, min(vocab, 30000), length)]


def _bits(seq) -> tuple[list[int], list[float]]:
    """(token ids, each sampled token's logprob) of one ``CompletionOutput``."""
    return list(seq.token_ids), [lp[t].logprob for lp, t in zip(seq.logprobs, seq.token_ids)]


def _engine_runs(llm, target, params, crowds: list[int], vocab: int, max_len: int) -> tuple[dict, list[dict]]:
    """The target's (tokens, logprobs) per sampling setting alone, and a line per crowd size and setting."""
    from paged_jax.sampling_params import SamplingParams

    rng = np.random.default_rng(1)
    alone, lines = {}, []
    for name, p in params.items():
        llm.reset_prefix_cache()
        alone[name] = _bits(llm.generate([target], p, use_tqdm=False)[0].outputs[0])
        for crowd in crowds:
            prompts = [{"prompt_token_ids": _prompt(rng, int(rng.integers(3, max_len)), vocab)} for _ in range(crowd)]
            others = [SamplingParams(temperature=0.0 if i % 3 == 0 else 0.8, seed=i, ignore_eos=True,
                                     max_tokens=int(rng.integers(4, 40))) for i in range(crowd)]
            at = crowd // 2
            llm.reset_prefix_cache()
            outputs = llm.generate(prompts[:at] + [target] + prompts[at:], others[:at] + [p] + others[at:],
                                   use_tqdm=False)
            lines.append({"check": "engine", "sampling": name, "crowd": crowd,
                          "same_bits": _bits(outputs[at].outputs[0]) == alone[name]})
            print(json.dumps(lines[-1]), flush=True)
    return alone, lines


def _research_checks(llm, target_ids: list[int], alone: dict, vocab: int) -> list[dict]:
    """``generate`` and ``score_tokens`` in the mode against the engine's runs of the target."""
    from paged_jax.research.generate import generate
    from paged_jax.research.scoring import score_tokens

    rng = np.random.default_rng(2)
    runner = llm.llm_engine.engine_core.runner  # its weights, in the engine's layout
    graphdef, state = runner._graphdef, jax.tree.unflatten(runner._state_treedef, runner.param_leaves)
    rows = [_prompt(rng, 50, vocab), target_ids, _prompt(rng, 7, vocab)]
    width = max(map(len, rows))
    tokens = np.array([r + [0] * (width - len(r)) for r in rows], np.int32)
    max_new = len(alone["greedy"][0])
    out = generate((graphdef, state), tokens, np.array([len(r) for r in rows], np.int32), max_new_tokens=max_new,
                   batch_invariant=True)
    lines = [{"check": "generate", "same_tokens": np.asarray(out.tokens[1]).tolist() == alone["greedy"][0],
              "same_logprobs": np.asarray(out.logprobs[1]).tolist() == alone["greedy"][1]}]
    sequences = [target_ids + alone["greedy"][0], _prompt(rng, 90, vocab), target_ids + alone["seeded"][0]]
    width = max(map(len, sequences)) + 5
    ids = np.array([s + [1] * (width - len(s)) for s in sequences], np.int32)
    scores = np.asarray(score_tokens((graphdef, state), ids, np.array([len(s) for s in sequences], np.int32),
                                     batch_invariant=True))
    for row, name in ((0, "greedy"), (2, "seeded")):
        got = scores[row, len(target_ids):len(sequences[row])]
        lines.append({"check": "score_tokens", "sampling": name, "same_logprobs": got.tolist() == alone[name][1],
                      "max_abs_diff": float(np.abs(got - np.asarray(alone[name][1], np.float32)).max())})
    for line in lines:
        print(json.dumps(line), flush=True)
    return lines


def invariance_section(args, model_kwargs: dict) -> list[dict]:
    from paged_jax import LLM, SamplingParams

    # The target's prompt (tiny: 40 tokens, else 300) takes two steps of prefill (tiny: 32, else 256 tokens).
    max_len, step_tokens, target_len = (64, 32, 40) if args.tiny_model else (600, 256, 300)
    # Half the device's memory: generate and score_tokens build their own KV pools and logits beside the engine's.
    llm = LLM(batch_invariant=True, dtype=args.dtype, max_model_len=4 * max_len, max_num_batched_tokens=step_tokens,
              max_num_seqs=64, enable_prefix_caching=True, gpu_memory_utilization=0.5, use_tqdm=False,
              **model_kwargs)
    vocab = llm.llm_engine.engine_core.runner.model_config.vocab_size
    target_ids = _prompt(np.random.default_rng(0), target_len, vocab)
    max_tokens = 6 if args.tiny else 24
    params = {"greedy": SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2),
              "seeded": SamplingParams(temperature=0.9, seed=5, max_tokens=max_tokens, ignore_eos=True, logprobs=2)}
    crowds = [int(c) for c in args.crowds.split(",")]
    alone, lines = _engine_runs(llm, {"prompt_token_ids": target_ids}, params, crowds, vocab, max_len)
    return lines + _research_checks(llm, target_ids, alone, vocab)


def engine_section(args, extra: list[str]) -> list[dict]:
    workloads = ({"tiny": ["--model", args.tiny_model, "--workload", "random", "--num-prompts", "2", "--input-len",
                           "12", "--output-len", "4", "--max-num-seqs", "2", "--max-num-batched-tokens", "16",
                           "--max-model-len", "128", "--dtype", "float32"]}
                 if args.tiny_model else {name: ENGINE_WORKLOADS[name] for name in args.workloads.split(",")})
    lines = []
    for name, argv in workloads.items():
        tok_s = {}
        for mode, flag in (("normal", []), ("invariant", ["--batch-invariant"])):
            with tempfile.NamedTemporaryFile(suffix=".json") as out:
                subprocess.run([sys.executable, "-m", "benchmarks.throughput", *argv, *flag, *extra,
                                "--out", out.name], check=True, stdout=subprocess.DEVNULL)
                tok_s[mode] = json.load(open(out.name))["output_tok_s"]
        lines.append({"check": "engine_cost", "workload": name, "normal_output_tok_s": tok_s["normal"],
                      "invariant_output_tok_s": tok_s["invariant"], "cost_ratio": tok_s["normal"] / tok_s["invariant"]})
        print(json.dumps(lines[-1]), flush=True)
    return lines


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sections", default="matmul,invariance,engine")
    p.add_argument("--preset", default="llama-3.1-8b", help="matmul shapes")
    p.add_argument("--rows", default="1,16,256,2048", help="comma-separated row counts M")
    p.add_argument("--impls", default="chunks",
                   help="the mode's matmul implementations to time (chunks, pallas; pallas:BNxBK[xS]: the kernel with "
                        "other column and K tiles and S K splits, an int or auto)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--invariance-shape", default="qwen3-0.6b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--crowds", default="7,40", help="other requests beside the target, per engine run")
    p.add_argument("--workloads", default="nano,batch1-8b", help=", ".join(ENGINE_WORKLOADS))
    p.add_argument("--tiny", action="store_true", help="CPU smoke settings")
    p.add_argument("--tiny-model", help=argparse.SUPPRESS)
    p.add_argument("--out", help="write the lines as JSON here")
    return p


def main(argv: list[str] | None = None) -> list[dict]:
    argv = sys.argv[1:] if argv is None else list(argv)
    extra = []
    if "--" in argv:
        argv, extra = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    args = build_parser().parse_args(argv)
    sections = args.sections.split(",")
    results = matmul_section(args) if "matmul" in sections else []
    with tempfile.TemporaryDirectory() as tmp:
        if args.tiny and not args.tiny_model and {"invariance", "engine"} & set(sections):
            from models.testing import save_random_hf_checkpoint, tiny_config

            # Vocabulary: the random workload's token ids.
            config = tiny_config("llama", vocab_size=10240)
            args.tiny_model = str(save_random_hf_checkpoint(config, f"{tmp}/tiny"))
        model_kwargs = (dict(model=args.tiny_model, weight_cache=False, num_gpu_blocks_override=256)
                        if args.tiny_model else dict(model=args.invariance_shape, load_format="dummy"))
        if "invariance" in sections:
            results += invariance_section(args, model_kwargs)
        if "engine" in sections:
            results += engine_section(args, extra)
    write_json(args.out, {"versions": versions(), "cases": results})
    return results


if __name__ == "__main__":
    main()
