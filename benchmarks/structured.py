"""Structured outputs on the engine: throughput with half of the requests JSON-schema constrained against the same
run unconstrained (same process, same prompts, same lengths), and grammar compile times.

Example (on the H200; dummy weights in a real shape, the grammar built over the SmolLM2 tokenizer padded to the
shape's vocabulary, since the GPU machine has no other tokenizer):
  python -m benchmarks.structured --shape qwen3-0.6b --max-concurrency 64 --async-scheduling --out $OUT/structured.json

The model is the shape with the tokenizer's own BOS / EOS ids (a config.json in a temporary directory, dummy
weights), as a real checkpoint pairs them: with the shape's EOS (151645 for Qwen3) past the SmolLM2 tokenizer's
49,152 ids, the grammars' vocabulary would have to reach it, and xgrammar would count the 100k ids between as special
tokens, scanned on every accepted token (a cost no real checkpoint has: Qwen3's own tokenizer leaves 267 padding ids).

Offline engine mode (``LLMEngine`` driven at ``--max-concurrency`` streams, as a server at that many concurrent
streams would see them). Every request sets ``ignore_eos``: once a constrained reply's grammar has ended only EOS is
allowed, so each request still runs to its workload length and both runs generate the same tokens.
Prints one JSON line per figure: ``grammar_compile_ms`` (p50 / p99 over the schemas, each compiled cold),
``grammar_host_us`` (host work per step for ``max_num_seqs / 2`` constrained rows: the bitmask fill and the matcher
advance, per row and per step; ``with_drafts``: speculative decoding's, 4 drafts a row validated and k + 1 rows a
grammar filled), ``throughput`` (per run: output tok/s and the physical floor's fraction),
``constrained_over_unconstrained`` (the throughput ratio; target >= 0.85).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time


def varied_schemas(count: int) -> list[dict]:
    """``count`` different JSON schemas: nested objects, enums, arrays, integers and numbers with bounds, booleans,
    bounded strings, in rotating combinations (also the test suite's varied schemas)."""
    parts = [
        lambda i: ("color", {"enum": ["red", "green", "blue", f"shade{i}"]}),
        lambda i: ("age", {"type": "integer", "minimum": i, "maximum": i + 50}),
        lambda i: ("score", {"type": "number", "minimum": 0, "maximum": 1}),
        lambda i: ("tags", {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1,
                            "maxItems": 1 + i % 3}),
        lambda i: ("home", {"type": "object", "properties": {"zip": {"type": "string", "pattern": "[0-9]{5}"},
                                                             "floor": {"type": "integer", "minimum": 0,
                                                                       "maximum": 9}},
                            "required": ["zip", "floor"], "additionalProperties": False}),
        lambda i: ("alive", {"type": "boolean"}),
        lambda i: ("name", {"type": "string", "minLength": 1, "maxLength": 6 + i % 5}),
    ]
    schemas = []
    for i in range(count):
        chosen = [parts[(i + k * (1 + i % 3)) % len(parts)](i) for k in range(1 + i % 2)]
        properties = {"id": {"type": "integer", "minimum": 0, "maximum": 100 + i}, **dict(chosen)}
        schemas.append({"type": "object", "properties": properties, "required": list(properties),
                        "additionalProperties": False})
    return schemas


def _shape_with_tokenizer_ids(shape: str, tokenizer_dir: str, model_dir: str) -> str:
    """Write ``model_dir/config.json``: the shape's HF config with the tokenizer's BOS / EOS ids; returns the dir."""
    from transformers import AutoTokenizer

    from models.presets import PRESETS

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = dict(PRESETS[shape.lower()], bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(config, f)
    return model_dir


def _grammar_host_us(engine, schemas: list[dict], num_rows: int, num_steps: int = 24) -> dict:
    """Host time of the grammar work of a step with ``num_rows`` constrained rows (one per schema in turn): the
    step's bitmask fill (``fill_step_bitmask``, rows of twice as many) and the matcher advance (``accept``) with a
    token the mask allows, as the engine does them; medians over ``num_steps`` steps."""
    import numpy as np

    from paged_jax import StructuredOutputsParams
    from paged_jax.structured_output import fill_step_bitmask
    from paged_jax.structured_output.backend import fill_threads

    manager = engine.engine_core.structured_outputs
    compiled = [manager.grammar_for(StructuredOutputsParams(json=schema)) for schema in schemas]
    grammars = [manager.new_sequence(compiled[i % len(compiled)]) for i in range(num_rows)]
    rng = np.random.default_rng(0)
    fill_s, accept_s = [], []
    for _ in range(num_steps):
        for i, grammar in enumerate(grammars):  # an ended grammar starts over (waits for the compile once)
            if grammar.live_matcher() is None:
                grammars[i] = manager.new_sequence(compiled[i % len(compiled)])
                grammars[i].live_matcher()
        start = time.perf_counter()
        bitmask = fill_step_bitmask(grammars, 2 * num_rows, engine.vocab_size)
        fill_s.append(time.perf_counter() - start)
        bits = np.unpackbits(bitmask[:num_rows].view(np.uint8), axis=1, bitorder="little")
        tokens = [int(rng.choice(np.flatnonzero(row))) for row in bits]
        start = time.perf_counter()
        for grammar, token in zip(grammars, tokens):
            grammar.accept(token)
        accept_s.append(time.perf_counter() - start)
    fill, accept = 1e6 * float(np.median(fill_s)), 1e6 * float(np.median(accept_s))
    return {"figure": "grammar_host_us", "rows": num_rows, "fill_per_step": fill, "fill_per_row": fill / num_rows,
            "accept_per_step": accept, "accept_per_row": accept / num_rows,
            "fill_threads": fill_threads(num_rows), "fill_per_step_by_threads": _fill_us_by_threads(grammars, engine),
            "with_drafts": _draft_host_us(grammars, engine.vocab_size),
            "grammar_vocab_size": grammars[0].backend.grammar_vocab_size}


def _draft_host_us(grammars: list, vocab_size: int, k: int = 4, repeats: int = 24) -> dict:
    """Speculative decoding's grammar work per step for ``grammars`` (``SequenceGrammar``s, at their current states)
    with up to ``k`` drafts each, a random path each grammar allows: validating the drafts (``validate_tokens``) and
    filling every sampled row (``fill_step_bitmask``: k + 1 rows a grammar), against the fill of one row each; median
    microseconds per step. The grammars are left where they were."""
    import numpy as np

    from paged_jax.structured_output import fill_step_bitmask

    rng = np.random.default_rng(1)
    drafts, first = {}, len(grammars)
    for row, grammar in enumerate(grammars):
        matcher, path = grammar.live_matcher(), []
        while matcher is not None and len(path) < k and not matcher.is_terminated():
            mask = fill_step_bitmask([grammar], 1, vocab_size)[0]
            path.append(int(rng.choice(np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")))))
            assert matcher.accept_token(path[-1])
        if path:
            matcher.rollback(len(path))
            drafts[row], first = (path, first), first + len(path)

    def median_us(fn) -> float:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return 1e6 * float(np.median(times))

    return {"k": k, "draft_tokens": first - len(grammars),
            "validate_per_step": median_us(lambda: [g.validate_tokens(drafts.get(i, ((), 0))[0])
                                                    for i, g in enumerate(grammars)]),
            "fill_per_step": median_us(lambda: fill_step_bitmask(grammars, first, vocab_size, drafts)),
            "fill_per_step_without_drafts": median_us(lambda: fill_step_bitmask(grammars, len(grammars), vocab_size))}


def _fill_us_by_threads(grammars: list, engine, repeats: int = 24) -> dict:
    """Median microseconds of one step's bitmask fill for ``grammars`` (their current states) on one thread and on
    the threads the engine uses from ``PARALLEL_FILL_MIN_ROWS`` rows on: the measurement behind that threshold."""
    import numpy as np

    from paged_jax.structured_output import backend as backend_module
    from paged_jax.structured_output import fill_step_bitmask
    from paged_jax.structured_output.backend import fill_threads

    threshold = backend_module.PARALLEL_FILL_MIN_ROWS
    medians = {}
    try:
        for label, min_rows in (("1", len(grammars) + 1), (str(fill_threads(1 << 30)), 1)):
            backend_module.PARALLEL_FILL_MIN_ROWS = min_rows
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                fill_step_bitmask(grammars, 2 * len(grammars), engine.vocab_size)
                times.append(time.perf_counter() - start)
            medians[label] = 1e6 * float(np.median(times))
    finally:
        backend_module.PARALLEL_FILL_MIN_ROWS = threshold
    return medians


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", required=True, help="named shape with dummy weights (models/presets.py)")
    p.add_argument("--tokenizer", help="HF tokenizer directory for the grammars (default: the built-in SmolLM2's)")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--max-input-len", type=int, default=1024, help="nano-vllm's prompt lengths: randint(100, this)")
    p.add_argument("--max-output-len", type=int, default=1024, help="nano-vllm's output lengths: randint(100, this)")
    p.add_argument("--max-concurrency", type=int, default=64)
    p.add_argument("--constrained-fraction", type=float, default=0.5)
    p.add_argument("--num-schemas", type=int, default=20)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--async-scheduling", action="store_true")
    p.add_argument("--out", help="write the JSON results here")
    args = p.parse_args(argv)

    from benchmarks.floors import workload_floor
    from benchmarks.report import versions, write_json
    from benchmarks.throughput import _run_with_concurrency
    from benchmarks.workloads import nanovllm
    from models.presets import preset_config
    from models.smollm2 import ensure_smollm2
    from paged_jax import LLM, SamplingParams, StructuredOutputsParams
    from paged_jax.structured_output.backend import XgrammarBackend, parse_grammar

    tokenizer = args.tokenizer or str(ensure_smollm2())
    model_dir = tempfile.mkdtemp(prefix="structured-model-")
    llm = LLM(model=_shape_with_tokenizer_ids(args.shape, tokenizer, model_dir), load_format="dummy",
              tokenizer=tokenizer, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
              async_scheduling=args.async_scheduling)
    engine = llm.llm_engine
    results: dict = {"versions": versions(), "argv": sys.argv[1:] if argv is None else argv}

    # Grammar compile time: each schema cold (a fresh compiler, no cache), the tokenizer's vocabulary scan apart.
    schemas = varied_schemas(args.num_schemas)
    start = time.perf_counter()
    backend = XgrammarBackend(engine.tokenizer, engine.vocab_size, engine.eos_token_ids)
    tokenizer_info_s = time.perf_counter() - start
    compile_ms = []
    for schema in schemas:
        start = time.perf_counter()
        backend.compile(parse_grammar(StructuredOutputsParams(json=schema)))
        compile_ms.append(1e3 * (time.perf_counter() - start))
    results["grammar_compile_ms"] = {"figure": "grammar_compile_ms", "n": len(compile_ms),
                                     "p50": _percentile(compile_ms, 0.5), "p99": _percentile(compile_ms, 0.99),
                                     "max": max(compile_ms), "tokenizer_info_s": tokenizer_info_s,
                                     "vocab_size": engine.vocab_size}
    print(json.dumps(results["grammar_compile_ms"]), flush=True)
    results["grammar_host_us"] = _grammar_host_us(engine, schemas, max(1, args.max_num_seqs // 2))
    print(json.dumps(results["grammar_host_us"]), flush=True)

    workload = nanovllm(args.num_prompts, args.max_input_len, args.max_output_len)
    requests = workload.requests
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    every = max(1, round(1 / args.constrained_fraction)) if args.constrained_fraction > 0 else None

    def params_for(constrained: bool) -> list:
        return [SamplingParams(temperature=workload.temperature, ignore_eos=True, max_tokens=r.max_tokens, seed=i,
                               structured_outputs=(StructuredOutputsParams(json=schemas[i % len(schemas)])
                                                   if constrained and every and i % every == 0 else None))
                for i, r in enumerate(requests)]

    # Warm-up: lazily created host state, and every schema compiled into the engine's cache before the clock runs
    # (compiles are off the critical path and measured above; the ratio is about the per-step cost).
    warm = params_for(True)[:len(schemas) * (every or 1)]
    llm.generate(prompts[:len(warm)], [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=4,
                                                      structured_outputs=w.structured_outputs) for w in warm],
                 use_tqdm=False)
    floor = workload_floor(preset_config(args.shape), workload, min(args.max_num_seqs, args.max_concurrency))
    for name, constrained in (("unconstrained", False), ("half_constrained", True)):
        params = params_for(constrained)
        start = time.perf_counter()
        out_tokens = _run_with_concurrency(engine, prompts, params, args.max_concurrency)
        elapsed = time.perf_counter() - start
        results[name] = {"figure": "throughput", "run": name, "output_tokens": out_tokens, "elapsed_s": elapsed,
                         "output_tok_s": out_tokens / elapsed,
                         "constrained_requests": sum(p.structured_outputs is not None for p in params),
                         "max_concurrency": args.max_concurrency, "floor_s": floor["floor_s"],
                         "fraction_of_floor": floor["floor_s"] / elapsed,
                         "num_compiles_since_warmup": engine.stats()["num_compiles_since_warmup"]}
        print(json.dumps(results[name]), flush=True)
    ratio = results["half_constrained"]["output_tok_s"] / results["unconstrained"]["output_tok_s"]
    results["ratio"] = {"figure": "constrained_over_unconstrained", "value": ratio, "target": 0.85}
    print(json.dumps(results["ratio"]), flush=True)
    write_json(args.out, results)
    return results


if __name__ == "__main__":
    main()
