"""Greedy agreement with transformers in float32: how many sequences match token for token.

A random-weight checkpoint of a named shape is written as HF safetensors; transformers (float32, TF32 off) and the
engine (``dtype="float32"``) each generate greedily from the same random prompts; the report counts identical
sequences and the first divergence of the others, once per ``--matmul-precision``: ``highest`` is the engine as it
is (float32 means full-precision matmuls), ``default`` traces it at JAX's default precision (TF32 on GPUs), to show
what the full-precision rule buys. The engine runs with few buckets (``max_num_seqs`` = the prompt count).

  python -m benchmarks.agreement --shape smollm2-135m --num-prompts 16 --matmul-precision default,highest
"""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile

import numpy as np


def _transformers_greedy(checkpoint: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).to(device).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor(prompts, device=device), max_new_tokens=max_tokens,
                             min_new_tokens=max_tokens, do_sample=False, num_beams=1, eos_token_id=None,
                             pad_token_id=0)
    return out[:, len(prompts[0]):].cpu().tolist()


def _engine_greedy(checkpoint: str, prompts: list[list[int]], max_tokens: int, precision: str) -> list[list[int]]:
    import models.llama
    from paged_jax.entrypoints.llm import LLM
    from paged_jax.sampling_params import SamplingParams

    full_precision = models.llama.matmul_precision
    if precision == "default":  # trace at JAX's default precision (what float32 meant before the rule)
        models.llama.matmul_precision = lambda dtype: contextlib.nullcontext()
    try:
        llm = LLM(checkpoint, dtype="float32", max_model_len=len(prompts[0]) + max_tokens, seed=0,
                  max_num_seqs=len(prompts), max_num_batched_tokens=len(prompts) * len(prompts[0]),
                  weight_cache=False, use_tqdm=False)
    finally:
        models.llama.matmul_precision = full_precision
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def main(argv: list[str] | None = None) -> dict:
    from models.presets import PRESETS
    from models.testing import save_random_hf_checkpoint

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="smollm2-135m", choices=sorted(PRESETS))
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--matmul-precision", default="default,highest",
                   help="comma list of: highest (the engine as it is), default (JAX's default precision)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out")
    args = p.parse_args(argv)

    config = dict(PRESETS[args.shape])
    rng = np.random.default_rng(args.seed)
    prompts = rng.integers(3, config["vocab_size"], (args.num_prompts, args.prompt_len)).tolist()
    with tempfile.TemporaryDirectory(prefix="agreement-") as checkpoint:
        save_random_hf_checkpoint(config, checkpoint, seed=args.seed)
        expected = _transformers_greedy(checkpoint, prompts, args.max_tokens)
        got = {precision: _engine_greedy(checkpoint, prompts, args.max_tokens, precision)
               for precision in args.matmul_precision.split(",")}
    import jax

    result = {"shape": args.shape, "device": str(jax.devices()[0]), "num_prompts": args.num_prompts,
              "prompt_len": args.prompt_len, "max_tokens": args.max_tokens}
    for precision, sequences in got.items():
        divergence = [next((i for i, (a, b) in enumerate(zip(e, g)) if a != b), None)
                      for e, g in zip(expected, sequences)]
        result[precision] = {"identical": sum(d is None for d in divergence), "first_divergence": divergence}
    print(json.dumps(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
