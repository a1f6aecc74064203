"""The standard workloads (nano-vllm's bench, vLLM's default throughput run, random prompts), built identically
for every engine we compare.

Each workload is a list of ``Req(prompt_token_ids, max_tokens)`` plus the sampling temperature it prescribes.
"""

from __future__ import annotations

import dataclasses
import random


@dataclasses.dataclass(frozen=True)
class Req:
    prompt_token_ids: list[int]
    max_tokens: int


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    requests: list[Req]
    temperature: float
    ignore_eos: bool = True

    @property
    def prompt_tokens(self) -> int:
        return sum(len(r.prompt_token_ids) for r in self.requests)

    @property
    def output_tokens(self) -> int:
        return sum(r.max_tokens for r in self.requests)


def nanovllm(num_requests: int = 256, max_input_len: int = 1024, max_output_len: int = 1024) -> Workload:
    """nano-vllm's bench.py: seed 0, prompts of randint(100, 1024) ids in [0, 10000], then output lengths
    randint(100, 1024); temperature 0.6, EOS ignored. 256 requests: 142,827 prompt / 133,966 output tokens."""
    rng = random.Random(0)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(100, max_input_len))] for _ in range(num_requests)]
    outputs = [rng.randint(100, max_output_len) for _ in range(num_requests)]
    return Workload("nano-vllm", [Req(p, o) for p, o in zip(prompts, outputs)], temperature=0.6)


def random_fixed(num_prompts: int, input_len: int, output_len: int, seed: int = 0, vocab: int = 10000) -> Workload:
    """vLLM ``bench throughput`` style: fixed input/output lengths, random token ids, all submitted at once.
    The default workload is 1000 x 1024 in / 128 out."""
    rng = random.Random(seed)
    reqs = [Req([rng.randint(0, vocab - 1) for _ in range(input_len)], output_len) for _ in range(num_prompts)]
    return Workload(f"random-{num_prompts}x{input_len}-{output_len}", reqs, temperature=1.0)


def by_name(name: str, *, num_prompts: int | None = None, input_len: int | None = None,
            output_len: int | None = None) -> Workload:
    if name == "nano-vllm":
        return nanovllm(num_prompts or 256)
    if name == "vllm-default":
        return random_fixed(num_prompts or 1000, input_len or 1024, output_len or 128)
    if name == "random":
        if input_len is None or output_len is None:
            raise ValueError("workload 'random' needs --input-len and --output-len")
        return random_fixed(num_prompts or 100, input_len, output_len)
    raise ValueError(f"unknown workload {name!r}; known: nano-vllm, vllm-default, random")
