"""Sampling rollouts from a jitted, training-style step with ``paged_jax.research.generate``.

The step takes the model *state* as an ordinary pytree argument (as a training loop holding ``nnx.state(model)``
would), draws ``--samples`` completions per prompt by ``jax.vmap`` over PRNG keys, and reduces them to per-sample
statistics (mean token logprob, length, whether EOS was reached) without leaving the device.

Run:
  python examples/rollouts.py                  # the built-in SmolLM2-135M-Instruct (built once, locally)
  python examples/rollouts.py --tiny           # a tiny random model, seconds on a CPU
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from paged_jax.research.generate import generate

QUESTIONS = [
    "What is the capital of France?",
    "Name a prime number larger than ten.",
    "Write one sentence about the ocean.",
    "What colour is the sky on a clear day?",
]


def load_smollm2(dtype: str):
    from transformers import AutoTokenizer

    from models.loader import load_model
    from models.smollm2 import ensure_smollm2

    model_dir = ensure_smollm2()
    model, config = load_model(model_dir, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    # Render the chat template to text, then tokenize (the return type of tokenize=True differs across versions).
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                           tokenize=False) for q in QUESTIONS]
    prompts = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    return model, config, tokenizer, prompts


def load_tiny():
    from models.config import ModelConfig
    from models.llama import LlamaForCausalLM
    from models.testing import tiny_config

    config = ModelConfig.from_hf_config(tiny_config())
    model = LlamaForCausalLM(config, dtype=jnp.float32, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, config.vocab_size, size=n).tolist() for n in (5, 9, 3, 12)]
    return model, config, None, prompts


def pad_prompts(prompts: list[list[int]], pad_token_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Right-pad token lists into int32[B, P] plus int32[B] lengths."""
    lengths = np.array([len(p) for p in prompts], np.int32)
    tokens = np.full((len(prompts), lengths.max()), pad_token_id, np.int32)
    for row, prompt in enumerate(prompts):
        tokens[row, :len(prompt)] = prompt
    return tokens, lengths


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="use a tiny random model instead of SmolLM2")
    parser.add_argument("--samples", type=int, default=4, help="completions per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--iterations", type=int, default=2, help="rollout steps to run (the first one compiles)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default=None, help="SmolLM2 dtype (default: float32 on CPU, bfloat16 otherwise)")
    args = parser.parse_args(argv)

    if args.tiny:
        model, config, tokenizer, prompts = load_tiny()
    else:
        dtype = args.dtype or ("float32" if jax.default_backend() == "cpu" else "bfloat16")
        model, config, tokenizer, prompts = load_smollm2(dtype)
    eos_token_ids = tuple(config.eos_token_ids)
    pad_token_id = eos_token_ids[0] if eos_token_ids else 0
    prompt_tokens, prompt_lengths = pad_prompts(prompts, pad_token_id)
    graphdef, state = nnx.split(model)
    max_new_tokens = args.max_new_tokens

    @jax.jit
    def rollout_step(state, prompt_tokens, prompt_lengths, key, temperature):
        """One rollout step: S samples per prompt -> (GenerateOutput [S, B, ...], per-sample stats [S, B])."""

        def one_sample(sample_key):
            return generate((graphdef, state), prompt_tokens, prompt_lengths, max_new_tokens=max_new_tokens,
                            rng=sample_key, temperature=temperature, top_p=args.top_p,
                            eos_token_id=eos_token_ids, pad_token_id=pad_token_id)

        out = jax.vmap(one_sample)(jax.random.split(key, args.samples))
        valid = jnp.arange(max_new_tokens) < out.lengths[..., None]  # [S, B, N]
        mean_logprob = jnp.sum(out.logprobs * valid, axis=-1) / out.lengths  # [S, B]
        stats = {"mean_logprob": mean_logprob, "length": out.lengths, "reached_eos": out.finished}
        return out, stats

    key = jax.random.key(args.seed)
    # A traced temperature: changing it between steps (e.g. an annealing schedule) does not recompile.
    temperature = jnp.float32(args.temperature)
    for iteration in range(args.iterations):
        key, step_key = jax.random.split(key)
        start = time.perf_counter()
        out, stats = jax.block_until_ready(rollout_step(state, prompt_tokens, prompt_lengths, step_key, temperature))
        elapsed = time.perf_counter() - start
        generated = int(jnp.sum(out.lengths))
        print(f"step {iteration}: {args.samples} samples x {len(prompts)} prompts, {generated} tokens in "
              f"{elapsed:.2f}s ({generated / elapsed:.1f} tok/s{', compile included' if iteration == 0 else ''}); "
              f"mean logprob {float(jnp.mean(stats['mean_logprob'])):.3f}, "
              f"EOS reached {float(jnp.mean(stats['reached_eos'])):.0%}")

    for row in range(len(prompts)):
        print(f"\nprompt {row}: " + (QUESTIONS[row] if tokenizer is not None else str(prompts[row])))
        for sample in range(min(args.samples, 2)):
            length = int(out.lengths[sample, row])
            tokens = np.asarray(out.tokens[sample, row, :length]).tolist()
            text = tokenizer.decode(tokens, skip_special_tokens=True) if tokenizer is not None else str(tokens)
            print(f"  sample {sample} (mean logprob {float(stats['mean_logprob'][sample, row]):.3f}): {text!r}")


if __name__ == "__main__":
    main()
