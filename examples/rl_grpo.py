"""GRPO with the engine as the rollout worker: sample with ``LLM``, score and train in JAX, push the new weights back.

Each step: the engine (awake) samples ``--samples`` completions per prompt, reporting each sampled token's logprob
under the distribution it sampled from (``logprobs_mode="processed_logprobs"``); the engine sleeps (its weights and
KV pool leave the device) while the trainer scores the same tokens with ``score_tokens`` under the same temperature,
computes group-normalized advantages from a verifiable reward and takes one clipped policy-gradient step (optax
Adam); the engine wakes up and takes the new weights with ``update_weights`` (no restart, no compile). It prints the
mean reward and the largest engine/trainer logprob gap of the step (float32 on both sides: ~1e-5).

Task: the built-in SmolLM2-135M-Instruct answers "What is A plus B?" (reward 1 when the reply contains the sum);
``--tiny`` uses a tiny random checkpoint whose reward is the fraction of completion tokens below vocab/4 (quick to
learn, seconds on a CPU).

Run (needs optax: ``pip install 'paged-jax[rl]'``):
  python examples/rl_grpo.py                 # the built-in model, float32 on the CPU
  python examples/rl_grpo.py --tiny --steps 3
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from models.loader import load_model
from paged_jax.entrypoints.llm import LLM
from paged_jax.research.scoring import score_tokens
from paged_jax.sampling_params import SamplingParams


def arithmetic_task(llm: LLM, num_prompts: int, rng: np.random.Generator):
    """(prompts as token ids, reward(prompt index, completion token ids, text) -> float)."""
    pairs = [tuple(int(x) for x in rng.integers(1, 20, size=2)) for _ in range(num_prompts)]
    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": f"What is {a} plus {b}? Answer with just "
                                               "the number."}], add_generation_prompt=True, tokenize=False)
               for a, b in pairs]
    token_ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in prompts]
    return token_ids, lambda i, tokens, text: float(str(sum(pairs[i])) in text)


def low_token_task(vocab_size: int, num_prompts: int, rng: np.random.Generator):
    """Random prompts; reward: the fraction of completion tokens below vocab_size / 4."""
    prompts = [rng.integers(3, vocab_size, size=6).tolist() for _ in range(num_prompts)]
    return prompts, lambda i, tokens, text: float(np.mean(np.asarray(tokens) < vocab_size // 4)) if tokens else 0.0


def pad_rollouts(rollouts: list[tuple[list[int], list[int]]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[(prompt ids, completion ids)] -> tokens int32[B, T] (right-padded), lengths int32[B], completion mask
    bool[B, T] (the positions whose token was sampled)."""
    lengths = np.array([len(p) + len(c) for p, c in rollouts], np.int32)
    tokens = np.zeros((len(rollouts), int(lengths.max())), np.int32)
    mask = np.zeros(tokens.shape, bool)
    for row, (prompt, completion) in enumerate(rollouts):
        tokens[row, :lengths[row]] = prompt + completion
        mask[row, len(prompt):lengths[row]] = True
    return tokens, lengths, mask


def make_train_step(graphdef, optimizer, temperature: float, clip: float):
    """One jitted GRPO step: clipped ratio of the trainer's to the rollout's (engine's) token logprobs times the
    group-normalized advantage, averaged over sampled tokens; -> (state, opt_state, loss, trainer logprobs)."""

    @jax.jit
    def train_step(state, opt_state, tokens, lengths, mask, engine_logprobs, advantages):
        def loss_fn(state):
            logprobs = score_tokens((graphdef, state), tokens, lengths, temperature=temperature)
            ratio = jnp.exp(logprobs - engine_logprobs)
            objective = jnp.minimum(ratio * advantages[:, None],
                                    jnp.clip(ratio, 1 - clip, 1 + clip) * advantages[:, None])
            return -jnp.sum(jnp.where(mask, objective, 0.0)) / jnp.sum(mask), logprobs

        (loss, logprobs), grads = jax.value_and_grad(loss_fn, has_aux=True)(state)
        updates, opt_state = optimizer.update(grads, opt_state, state)
        return optax.apply_updates(state, updates), opt_state, loss, logprobs

    return train_step


def rollout(llm: LLM, prompts, reward, params: SamplingParams):
    """Sample; -> (rollouts [(prompt, completion)], engine logprobs per completion, rewards float32[B])."""
    rollouts, engine_logprobs, rewards = [], [], []
    for index, output in enumerate(llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                use_tqdm=False)):
        for completion in output.outputs:
            tokens = list(completion.token_ids)
            rollouts.append((prompts[index], tokens))
            engine_logprobs.append([lp[t].logprob for lp, t in zip(completion.logprobs, tokens)])
            rewards.append(reward(index, tokens, completion.text))
    return rollouts, engine_logprobs, np.asarray(rewards, np.float32)


def run(args: argparse.Namespace) -> list[dict]:
    """The GRPO loop; returns one dict per step (reward, logprob_gap, loss) and prints it."""
    rng = np.random.default_rng(args.seed)
    if args.tiny:
        from models.testing import save_random_hf_checkpoint, tiny_config

        model_path = str(save_random_hf_checkpoint(tiny_config("llama"), Path(tempfile.mkdtemp()) / "tiny"))
    else:
        from models.smollm2 import ensure_smollm2

        model_path = str(ensure_smollm2())
    llm = LLM(model=model_path, dtype="float32", enable_sleep_mode=True, logprobs_mode="processed_logprobs",
              max_model_len=args.max_model_len, max_num_seqs=args.prompts * args.samples, weight_cache=False,
              use_tqdm=False)
    model, config = load_model(model_path, dtype="float32")  # the trainer's copy, the engine's starting weights
    if args.tiny:
        prompts, reward = low_token_task(config.vocab_size, args.prompts, rng)
    else:
        prompts, reward = arithmetic_task(llm, args.prompts, rng)
    graphdef, state = nnx.split(model)
    optimizer = optax.adam(args.learning_rate)
    opt_state = optimizer.init(state)
    train_step = make_train_step(graphdef, optimizer, args.temperature, args.clip)
    history = []
    for step in range(args.steps):
        params = SamplingParams(n=args.samples, temperature=args.temperature, max_tokens=args.max_tokens, logprobs=0,
                                seed=int(rng.integers(1 << 31)))
        rollouts, engine_logprobs, rewards = rollout(llm, prompts, reward, params)
        llm.sleep(level=2)  # the trainer's phase: the engine's weights and KV pool leave the device

        grouped = rewards.reshape(len(prompts), args.samples)
        advantages = ((grouped - grouped.mean(1, keepdims=True)) / (grouped.std(1, keepdims=True) + 1e-4)).ravel()
        tokens, lengths, mask = pad_rollouts(rollouts)
        old = np.zeros(tokens.shape, np.float32)
        for row, (prompt, completion) in enumerate(rollouts):
            old[row, len(prompt):len(prompt) + len(completion)] = engine_logprobs[row]
        state, opt_state, loss, trainer_logprobs = train_step(state, opt_state, tokens, lengths, mask, old,
                                                              advantages)
        gap = float(np.max(np.abs(np.where(mask, np.asarray(trainer_logprobs) - old, 0.0))))

        llm.wake_up(tags=["weights"])
        llm.update_weights(state)  # device to device; fused projections re-applied; prefix cache reset
        llm.wake_up(tags=["kv_cache"])
        history.append({"step": step, "reward": float(rewards.mean()), "logprob_gap": gap, "loss": float(loss)})
        print(f"step {step}: reward {rewards.mean():.3f}  engine/trainer logprob gap {gap:.2e}  loss {loss:.4f}")
    return history


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="a tiny random checkpoint (seconds on a CPU)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step")
    parser.add_argument("--samples", type=int, default=4, help="completions per prompt (the GRPO group)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--learning-rate", type=float, default=1e-5)
    parser.add_argument("--clip", type=float, default=0.2, help="PPO-style ratio clip")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


if __name__ == "__main__":
    run(parse_args())
