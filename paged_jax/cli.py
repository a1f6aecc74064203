"""The ``paged-jax`` command.

    paged-jax serve [MODEL] [flags]          OpenAI-compatible server (see ``serving.cli``)
    paged-jax generate [--model DIR] --prompt TEXT [--prompt TEXT ...] [--chat] [--max-tokens N] [--temperature T]
                       [--top-p P] [--top-k K] [--seed S] [engine flags, e.g. --max-model-len 2048]

``generate`` runs offline through ``paged_jax.LLM`` and prints one completion per prompt. Its engine flags are every
``EngineArgs`` field, spelled as vLLM spells them (``--max-num-seqs``, ``--num-gpu-blocks-override``, ...).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
from collections.abc import Sequence

from paged_jax.config import EngineArgs

_USAGE = "usage: paged-jax {serve,generate} ...\n"


def _engine_flag_type(field: dataclasses.Field):
    """The argparse converter of an ``EngineArgs`` field (its annotation is a string under __future__ annotations)."""
    hints = typing.get_type_hints(EngineArgs)
    hint = hints[field.name]
    if typing.get_origin(hint) is typing.Literal:
        return str, list(typing.get_args(hint))
    args = [a for a in typing.get_args(hint) if a is not type(None)]  # X | None -> X
    base = args[0] if args else hint
    if typing.get_origin(base) is typing.Literal:
        return str, list(typing.get_args(base))
    if base is bool:
        return bool, None
    return base, None


def build_generate_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="paged-jax generate", description="Offline generation with paged-jax.")
    parser.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for several)")
    parser.add_argument("--chat", action="store_true", help="wrap each prompt as a user turn of the chat template")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--sampling-seed", type=int, default=None, help="SamplingParams.seed")
    engine = parser.add_argument_group("engine (EngineArgs, vLLM names)")
    for field in dataclasses.fields(EngineArgs):
        flag = "--" + field.name.replace("_", "-")
        converter, choices = _engine_flag_type(field)
        if converter is bool:
            engine.add_argument(flag, dest=field.name, action=argparse.BooleanOptionalAction, default=field.default)
        else:
            engine.add_argument(flag, dest=field.name, type=converter, choices=choices, default=field.default)
    return parser


def generate_main(argv: Sequence[str]) -> int:
    from paged_jax.llm import LLM
    from paged_jax.sampling_params import SamplingParams

    parser = build_generate_parser()
    args = parser.parse_args(list(argv))
    engine_kwargs = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineArgs)}
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, seed=args.sampling_seed)
        llm = LLM(**engine_kwargs)
        if args.chat:
            outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params)
        else:
            outputs = llm.generate(args.prompt, params)
    except ValueError as exc:
        parser.error(str(exc))
    for prompt, output in zip(args.prompt, outputs):
        completion = output.outputs[0]
        print(f"=== {prompt!r} -> ({completion.finish_reason})")
        print(completion.text)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        sys.stdout.write(_USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "serve":
        from serving.cli import main as serve_main

        return serve_main(rest, prog="paged-jax serve")
    if command == "generate":
        return generate_main(rest)
    sys.stderr.write(_USAGE + f"paged-jax: unknown command {command!r}\n")
    return 2


if __name__ == "__main__":
    sys.exit(main())
