"""The ``paged-jax`` command: one line per subcommand in ``--help``, each handed to its home (``serving.cli`` for
``serve``, ``paged_jax.entrypoints.cli`` for ``generate``, ``serving.run_batch``, ``serving.bench``)."""

from __future__ import annotations

import sys
from typing import Sequence

from paged_jax.entrypoints.cli import generate_main
from serving.bench import bench_main
from serving.cli import serve_main
from serving.run_batch import run_batch_main

_USAGE = """usage: paged-jax {serve,generate,run-batch,bench} ...

commands:
  serve [MODEL] [flags]   the OpenAI-compatible server (vLLM's `vllm serve`); `paged-jax serve --help` for flags
  generate [flags]        complete prompts offline and print them; `paged-jax generate --help` for flags
  run-batch -i IN -o OUT  answer an OpenAI batch file (JSONL) offline (vLLM's `vllm run-batch`)
  bench serve             load a running server: TTFT, TPOT, ITL and throughput (vLLM's `vllm bench serve`)
  bench throughput        offline throughput on random prompts (vLLM's `vllm bench throughput`)
  bench latency           offline latency of one batch (vLLM's `vllm bench latency`)

docs/cli.md lists every flag with its default.
"""


def main(argv: Sequence[str] | None = None) -> int:
    """The ``paged-jax`` console script: ``serve`` in ``serving.cli``, ``generate`` in ``paged_jax.entrypoints.cli``,
    ``run-batch`` in ``serving.run_batch``, ``bench`` in ``serving.bench``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        sys.stdout.write(_USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "serve":
        return serve_main(rest, prog="paged-jax serve")
    if command == "generate":
        return generate_main(rest)
    if command == "run-batch":
        return run_batch_main(rest)
    if command == "bench":
        return bench_main(rest)
    sys.stderr.write(_USAGE + f"paged-jax: unknown command {command!r}\n")
    return 2
