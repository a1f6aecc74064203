"""Speculative decoding (issue 48): what a verify step and a model drafter cost, and what drafts buy end to end.

``verify``: the model runner for a named shape with dummy weights (default Llama-3.1-8B); for each batch B and draft
count k, the median ``execute(...).result()`` of a step in which every one of B sequences (``--context`` cached
tokens) computes its next token and k drafts, the target sampled at each of the k + 1 positions (one ragged step).
k = 0 is the plain decode step. Each k runs on its own runner, built as an engine with ``num_speculative_tokens = k``
and the step limits ``--max-num-seqs`` / ``--max-num-batched-tokens`` (the engine's GPU defaults) builds it: its
buckets (``paged_jax.worker.buckets``: with k, the verify buckets S * (1 + k)) and sampler row counts; its warm-up
compiles only the buckets and the sampler the timed steps run. Each case reports its bucket and sampler rows; with
``--trace TOP`` also its device busy time per step and top kernels (what the step costs on the device, apart from
the host's packing and the gaps).
``ratio`` = verify ms / plain decode ms: a draft of acceptance length L pays off when L > ratio.

``e2e``: batch-1 generation through the engine (``LLMEngine``), one request at a time, on a workload whose outputs
copy their inputs (the model is asked to repeat a passage word for word), without drafts and with each of
``--methods``: tokens/s, speedup over plain decoding, vLLM's mean acceptance length and draft counters. Greedy, so
every method's tokens equal the plain run's (checked, reported as ``same_tokens``). Needs a real instruct
checkpoint (``--model``; default the built-in SmolLM2-135M-Instruct): dummy weights copy nothing.

``drafter``: the same steps with a model drafter on the device (``draft_model``: dummy ``--draft-shape``, default
Llama-3.2-1B; ``eagle``: a dummy EAGLE head of the target's shape, sharing its embedding and LM head; ``eagle3``: a
dummy EAGLE-3 head of the target's shape, 32000 draft tokens; ``mtp``: a dummy DeepSeek-V3 multi-token prediction
layer, ``--shape deepseek-v3`` with ``--num-layers`` target layers: the MTP layer's cost does not depend on them, and
671B weights fit no single GPU), per batch: the plain
decode step, the verify step alone (k drafts, no drafter) and propose + verify (the drafter's catch-up and k draft
steps after the sampler), each as ms and as a ratio to plain decode. A drafter of acceptance length L pays off
when L > propose + verify ratio.

Examples (H100): ``python -m benchmarks.spec_decode verify --out $OUT/spec_verify.json``;
``python -m benchmarks.spec_decode drafter --drafter eagle3 --out $OUT/spec_eagle3.json`` (and
``--drafter eagle``, ``--drafter draft_model``);
``python -m benchmarks.spec_decode drafter --drafter mtp --shape deepseek-v3 --num-layers 4 --k 1 --out
$OUT/spec_mtp.json`` (the 4-layer target and its MTP layer: about 53 GB of bf16 weights);
``python -m benchmarks.spec_decode e2e --model meta-llama/Llama-3.1-8B-Instruct --out $OUT/spec_e2e.json`` (add
``--methods ngram,eagle3 --eagle3-model yuhuili/EAGLE3-LLaMA3.1-Instruct-8B``, ``--methods eagle --eagle-model
HEAD_DIR`` or ``--methods draft_model
--draft-model meta-llama/Llama-3.2-1B-Instruct`` for the model drafters).
On CPU: ``verify --tiny --batches 1,2 --ks 0,2``, ``drafter --tiny --batches 1,2 --k 2`` (also ``--drafter mtp``) and
``e2e --max-tokens 32 --num-prompts 1`` check the script.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time

import numpy as np

from benchmarks.report import median_seconds, write_json
from benchmarks.trace import trace_kernels

PASSAGES = [
    "The history of astronomy spans thousands of years. Early civilizations watched the sky to keep track of the "
    "seasons, to plan harvests and to navigate across deserts and oceans. The Babylonians recorded the motions of "
    "the planets on clay tablets, and Greek thinkers such as Aristarchus suggested that the Earth moves around the "
    "Sun.",
    "def merge_sorted(a, b):\n    out = []\n    i = j = 0\n    while i < len(a) and j < len(b):\n        if a[i] <= "
    "b[j]:\n            out.append(a[i])\n            i += 1\n        else:\n            out.append(b[j])\n          "
    "  j += 1\n    out.extend(a[i:])\n    out.extend(b[j:])\n    return out\n",
    "Bread was baked in Egypt, noodles were made in China, and spices travelled along trade routes that connected "
    "distant cultures. Music, mathematics and medicine all grew through the same kind of exchange of ideas, carried "
    "by merchants, scholars and travellers from one city to the next.",
    "Dear team, the quarterly review is moved to Thursday at 10:00 in room 4B. Please bring the updated budget "
    "figures, the hiring plan for the next two quarters and a short summary of the open customer issues. Thanks, "
    "Maria.",
]


def _parse_ints(text: str) -> list[int]:
    return [int(v) for v in filter(None, text.split(","))]


# ---------------------------------------------------------------------------------------------------- verify
def _runner(model, config, num_speculative_tokens: int, batches: list[int], args, drafter=None):
    """-> (runner, blocks per sequence, {batch: its step's bucket}): a runner built as the engine builds one with
    ``num_speculative_tokens`` (its buckets for ``args``' step limits), whose warm-up compiles only what steps of
    ``batches`` sequences with that many drafts each run: their buckets' forwards (and drafter programs) and, at
    their sampler row counts, the sampler of the benchmark's sampling mode."""
    from paged_jax.worker.buckets import pick_bucket
    from paged_jax.worker.model_runner import ModelRunner
    from paged_jax.worker.sampler import SamplingMode
    from paged_jax.worker.warm_up import jobs_for_buckets

    if max(batches) > args.max_num_seqs or max(batches) * (1 + num_speculative_tokens) > args.max_num_batched_tokens:
        raise SystemExit(f"a step of {max(batches)} sequences with {num_speculative_tokens} drafts each exceeds "
                         f"--max-num-seqs {args.max_num_seqs} / --max-num-batched-tokens {args.max_num_batched_tokens}")
    blocks_per_seq = -(-(args.context + 1 + num_speculative_tokens) // args.block_size)
    runner = ModelRunner(model, config, num_blocks=max(batches) * blocks_per_seq + 1, block_size=args.block_size,
                         max_model_len=args.context + 64, max_num_seqs=args.max_num_seqs,
                         max_num_batched_tokens=args.max_num_batched_tokens, attention_impl=args.attention_impl,
                         num_speculative_tokens=num_speculative_tokens, drafter=drafter)
    buckets = {batch: pick_bucket(runner.buckets, batch * (1 + num_speculative_tokens), batch) for batch in batches}
    mode = SamplingMode.GREEDY if args.temperature == 0 else SamplingMode.GREEDY_OR_TEMPERATURE
    runner.warm_up(use_tqdm=False, jobs=jobs_for_buckets(runner, list(buckets.values()), {mode.value}))
    return runner, blocks_per_seq, buckets


def _case(runner, bucket: tuple[int, int]) -> dict:
    """What a step of ``bucket`` runs: its bucket, its sampler's rows, the compiles after warm-up."""
    return {"bucket": list(bucket), "sample_rows": runner.layout(*bucket).num_sample_rows,
            "num_compiles_since_warmup": runner.num_compiles_since_warmup}


def _time_verify(runner, blocks_per_seq: int, batch: int, k: int, args, config, rng) -> tuple[float, dict]:
    """(median ms of the step where ``batch`` sequences each compute their next token and ``k`` drafts, with
    ``args.trace`` its device kernels per step (``benchmarks.trace``: busy time, the top kernels; empty on CPU))."""
    from paged_jax.core.hand_steps import HandScheduler
    from paged_jax.sampling_params import SamplingParams

    params = SamplingParams(temperature=args.temperature, ignore_eos=True, max_tokens=1 << 20)
    hand = HandScheduler()
    vocab = min(config.vocab_size, 10000)
    for i in range(batch):
        request = hand.add(f"s{i}", rng.integers(0, vocab, args.context + 1).tolist(),
                           list(range(1 + i * blocks_per_seq, 1 + (i + 1) * blocks_per_seq)), params=params, seed=i,
                           num_computed_tokens=args.context)
        request.spec_token_ids = rng.integers(0, vocab, k).tolist()
    plan = {f"s{i}": 1 + k for i in range(batch)}
    runner.execute(hand.step(plan)).result()  # makes the rows
    step = hand.step(plan)  # the same rows, tokens and drafts again: a diff with nothing new
    ms = median_seconds(lambda: runner.execute(step).result(), args.repeats) * 1e3
    trace = {}
    if args.trace:  # the same steps back to back under the profiler: device time apart from the host's
        trace = trace_kernels(lambda: [runner.execute(step).result() for _ in range(args.repeats)], args.repeats,
                              args.trace)
    for req_id in list(hand.requests):
        hand.finish(req_id)
    runner.execute(hand.step({}))  # drops the rows
    return ms, {"trace": trace} if args.trace else {}


def _dummy_model(args, shape: str, architecture: str = "llama", **tiny_overrides):
    """(model, config): dummy weights of a named shape (``args.num_layers`` decoder layers when set) or with
    ``args.tiny`` a 2-layer tiny config of ``architecture``, projections fused as the engine runs them."""
    import dataclasses

    import jax.numpy as jnp

    from models.config import ModelConfig
    from models.llama import fuse_projections
    from models.loader import init_dummy_model
    from models.presets import preset_config

    if args.tiny:
        from models.testing import tiny_config
        config = ModelConfig.from_hf_config(tiny_config(architecture, vocab_size=1024, **tiny_overrides))
    else:
        config = preset_config(shape)
        if getattr(args, "num_layers", None):
            config = dataclasses.replace(config, num_hidden_layers=args.num_layers)
    model = init_dummy_model(config, dtype=jnp.dtype(args.dtype), seed=0)
    import paged_jax.ops  # noqa: F401  (registers the kernels with the model)

    return fuse_projections(model), config


def run_verify(args) -> dict:
    import jax

    model, config = _dummy_model(args, args.shape)
    batches, ks = _parse_ints(args.batches), _parse_ints(args.ks)
    rng = np.random.default_rng(0)
    result = {"benchmark": "spec_decode_verify", "shape": "tiny" if args.tiny else args.shape, "dtype": args.dtype,
              "device": str(jax.devices()[0].device_kind), "context": args.context,
              "temperature": args.temperature, "cases": []}
    plain: dict[int, float] = {}
    for k in sorted(set(ks)):  # each k on its own runner, as an engine with num_speculative_tokens = k
        runner, blocks_per_seq, buckets = _runner(model, config, k, batches, args)
        for batch in batches:
            ms, trace = _time_verify(runner, blocks_per_seq, batch, k, args, config, rng)
            if k == 0:
                plain[batch] = ms
            row = {"batch": batch, "k": k, "step_ms": round(ms, 3),
                   "ratio": round(ms / plain[batch], 3) if batch in plain else None, **_case(runner, buckets[batch]),
                   **trace}
            result["cases"].append(row)
            print(json.dumps(row), flush=True)
        runner.close()
        del runner
        gc.collect()
    return result


# ---------------------------------------------------------------------------------------------------- drafter
def _drafter(args, model, config):
    """A ``DraftRunner`` with dummy weights for the target ``model`` of ``config``."""
    import dataclasses

    import jax.numpy as jnp
    from flax import nnx

    from models.eagle import EagleConfig, EagleHead
    from models.eagle3 import Eagle3Config, Eagle3Head, default_aux_hidden_layers
    from models.mtp import init_dummy_mtp_head
    from paged_jax.spec_decode.draft_runner import DraftRunner

    if args.drafter == "draft_model":
        draft, draft_config = _dummy_model(args, args.draft_shape, num_hidden_layers=1)
        return DraftRunner("draft_model", args.k, draft, draft_config)
    shared = (model.model.embed_tokens.embedding[...], None if model.lm_head is None else model.lm_head.kernel[...])
    if args.drafter == "mtp":
        head = init_dummy_mtp_head(config, target_embedding=shared[0], target_lm_head=shared[1],
                                   dtype=jnp.dtype(args.dtype))
        return DraftRunner("mtp", args.k, head, head.config, shared=shared)
    if args.drafter == "eagle":
        head_config = EagleConfig(model=dataclasses.replace(config, num_hidden_layers=1))
        head = EagleHead(head_config, config, fc_bias=False, dtype=jnp.dtype(args.dtype), rngs=nnx.Rngs(0))
        head.embed_tokens.embedding.set_value(shared[0])
        if head.lm_head is not None:
            head.lm_head.set_value(shared[1])
        return DraftRunner("eagle", args.k, head, head_config.model, shared=shared)
    head_config = Eagle3Config(model=dataclasses.replace(config, num_hidden_layers=1),
                               draft_vocab_size=min(32000, config.vocab_size), target_hidden_size=config.hidden_size,
                               aux_hidden_layers=default_aux_hidden_layers(config.num_hidden_layers))
    head = Eagle3Head(head_config, dtype=jnp.dtype(args.dtype), rngs=nnx.Rngs(0))
    return DraftRunner("eagle3", args.k, head, head_config.model, aux_hidden_layers=head_config.aux_hidden_layers)


def run_drafter(args) -> dict:
    import jax

    tiny = {"architecture": "deepseek_v3", "num_nextn_predict_layers": 1} if args.drafter == "mtp" else {}
    model, config = _dummy_model(args, args.shape, num_hidden_layers=8, **tiny)
    batches, k = _parse_ints(args.batches), args.k
    rng = np.random.default_rng(0)
    result = {"benchmark": "spec_decode_drafter", "drafter": args.drafter,
              "shape": "tiny" if args.tiny else args.shape, "draft_shape": None if args.drafter != "draft_model" else
              ("tiny" if args.tiny else args.draft_shape), "dtype": args.dtype,
              "device": str(jax.devices()[0].device_kind), "context": args.context, "k": k, "cases": []}
    timings: dict[tuple[str, int], float] = {}
    for name, steps_k, drafter in (("plain", 0, None), ("verify", k, None), ("propose_verify", k, True)):
        runner, blocks_per_seq, buckets = _runner(model, config, steps_k, batches, args,
                                                  drafter=_drafter(args, model, config) if drafter else None)
        for batch in batches:
            ms, trace = _time_verify(runner, blocks_per_seq, batch, steps_k, args, config, rng)
            timings[name, batch] = ms
            row = {"step": name, "batch": batch, "k": steps_k, "step_ms": round(ms, 3),
                   "ratio": round(ms / timings["plain", batch], 3), **_case(runner, buckets[batch]), **trace}
            result["cases"].append(row)
            print(json.dumps(row), flush=True)
        runner.close()
        del runner
        gc.collect()
    return result


# ---------------------------------------------------------------------------------------------------- e2e
def _copy_prompts(tokenizer, num_prompts: int) -> list[list[int]]:
    prompts = []
    for passage in (PASSAGES * num_prompts)[:num_prompts]:
        messages = [{"role": "user", "content": f"Repeat the following text exactly, word for word, and say "
                                                f"nothing else:\n\n{passage}"}]
        ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return prompts


def _generate_one_at_a_time(engine, prompts, max_tokens: int) -> tuple[list[list[int]], float]:
    from paged_jax.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    outputs, seconds = [], 0.0
    for i, prompt in enumerate(prompts):
        start = time.perf_counter()
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params)
        tokens: list[int] = []
        while engine.has_unfinished_requests():
            for output in engine.step():
                tokens += output.outputs[0].token_ids
        seconds += time.perf_counter() - start
        outputs.append(tokens)
    return outputs, seconds


def run_e2e(args) -> dict:
    import jax

    from paged_jax.config import EngineArgs
    from paged_jax.engine.llm_engine import LLMEngine
    from paged_jax.spec_decode.verify import mean_acceptance_length

    result = {"benchmark": "spec_decode_e2e", "model": args.model or "smollm2-135m-instruct",
              "device": str(jax.devices()[0].device_kind), "max_tokens": args.max_tokens, "k": args.k, "runs": []}
    extra = {"ngram": {"prompt_lookup_min": 2, "prompt_lookup_max": 5}, "draft_model": {"model": args.draft_model},
             "eagle": {"model": args.eagle_model}, "eagle3": {"model": args.eagle3_model}}
    configs = [("plain", None)] + [(m, {"method": m, "num_speculative_tokens": args.k, **extra.get(m, {})})
                                   for m in filter(None, args.methods.split(","))]
    reference = None
    for name, spec in configs:
        engine = LLMEngine(EngineArgs(model=args.model, max_model_len=args.max_model_len, max_num_seqs=4,
                                      dtype=args.dtype, speculative_config=spec), use_tqdm=False)
        prompts = _copy_prompts(engine.tokenizer, args.num_prompts)
        _generate_one_at_a_time(engine, prompts[:1], 8)  # first-call effects
        before = dict(engine.stats())
        outputs, seconds = _generate_one_at_a_time(engine, prompts, args.max_tokens)
        stats = {key: value - before.get(key, 0) for key, value in engine.stats().items()
                 if key.startswith("spec_decode_")}
        num_tokens = sum(map(len, outputs))
        reference = reference or (outputs, num_tokens / seconds)
        run = {"method": name, "tokens": num_tokens, "seconds": round(seconds, 3),
               "tokens_per_s": round(num_tokens / seconds, 2),
               "speedup": round(num_tokens / seconds / reference[1], 3), "same_tokens": outputs == reference[0],
               "mean_acceptance_length": mean_acceptance_length(stats), **stats}
        result["runs"].append(run)
        print(json.dumps(run), flush=True)
        engine.engine_core.close()
        del engine
        gc.collect()
    return result


def _runner_args(parser) -> None:
    parser.add_argument("--trace", type=int, metavar="TOP", default=0,
                        help="also trace each case's steps (jax.profiler): device busy time per step and the TOP "
                             "kernels, to tell device work from host work and gaps (a GPU diagnostic)")
    parser.add_argument("--max-num-seqs", type=int, default=256,
                        help="the engine's max_num_seqs (its GPU default); with the next, the runner's buckets")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192,
                        help="the engine's max_num_batched_tokens (its GPU default)")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="part", required=True)
    verify = sub.add_parser("verify", help="verify-step cost against a plain decode step")
    verify.add_argument("--shape", default="llama-3.1-8b", help="named shape (models/presets.py)")
    verify.add_argument("--tiny", action="store_true", help="a 2-layer random config (CPU check of the script)")
    verify.add_argument("--dtype", default="bfloat16")
    verify.add_argument("--batches", default="1,8,64")
    verify.add_argument("--ks", default="0,1,2,3,4,5,6,7,8", help="draft counts (0: the plain decode step)")
    verify.add_argument("--context", type=int, default=1024, help="cached tokens per sequence")
    verify.add_argument("--block-size", type=int, default=16)
    verify.add_argument("--temperature", type=float, default=0.0)
    verify.add_argument("--repeats", type=int, default=20)
    verify.add_argument("--attention-impl", default="auto")
    _runner_args(verify)
    drafter = sub.add_parser("drafter", help="propose + verify step cost of a model drafter against plain decode")
    drafter.add_argument("--drafter", choices=("eagle3", "eagle", "draft_model", "mtp"), default="eagle3")
    drafter.add_argument("--shape", default="llama-3.1-8b", help="the target's named shape (models/presets.py)")
    drafter.add_argument("--draft-shape", default="llama-3.2-1b", help="draft_model: the draft's named shape")
    drafter.add_argument("--num-layers", type=int, help="the target's decoder layers (default: the shape's)")
    drafter.add_argument("--tiny", action="store_true", help="tiny random configs (CPU check of the script)")
    drafter.add_argument("--dtype", default="bfloat16")
    drafter.add_argument("--batches", default="1,8,64")
    drafter.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    drafter.add_argument("--context", type=int, default=1024, help="cached tokens per sequence")
    drafter.add_argument("--block-size", type=int, default=16)
    drafter.add_argument("--temperature", type=float, default=0.0)
    drafter.add_argument("--repeats", type=int, default=20)
    drafter.add_argument("--attention-impl", default="auto")
    _runner_args(drafter)
    e2e = sub.add_parser("e2e", help="batch-1 tokens/s on a copy workload, plain vs ngram / suffix")
    e2e.add_argument("--model", default=None, help="checkpoint (default: the built-in SmolLM2-135M-Instruct)")
    e2e.add_argument("--dtype", default="auto")
    e2e.add_argument("--methods", default="ngram,suffix",
                     help="also draft_model, eagle, eagle3 (with their checkpoints), mtp (--model with MTP layers)")
    e2e.add_argument("--draft-model", help="draft_model: the draft checkpoint (the target's tokenizer)")
    e2e.add_argument("--eagle-model", help="eagle: the EAGLE head checkpoint for --model")
    e2e.add_argument("--eagle3-model", help="eagle3: the EAGLE-3 head checkpoint for --model")
    e2e.add_argument("--k", type=int, default=5, help="num_speculative_tokens")
    e2e.add_argument("--num-prompts", type=int, default=4)
    e2e.add_argument("--max-tokens", type=int, default=256)
    e2e.add_argument("--max-model-len", type=int, default=1024)
    for parser in (verify, drafter, e2e):
        parser.add_argument("--out")
    args = p.parse_args(argv)
    result = {"verify": run_verify, "drafter": run_drafter, "e2e": run_e2e}[args.part](args)
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
