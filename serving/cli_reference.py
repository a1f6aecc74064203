"""The command-line flag reference, docs/cli.md, generated from the argument parsers.

    python -m serving.cli_reference > docs/cli.md

``cli_reference()`` returns the Markdown. It reads only what argparse records of each flag (option strings, metavar,
nargs, default, choices, help) and the parsers' argument groups, from the functions that build the full parsers:
``serving.cli.build_parser`` (``paged-jax serve``), ``paged_jax.entrypoints.cli.build_generate_parser`` (``paged-jax
generate``), ``serving.run_batch.build_run_batch_parser`` (``paged-jax run-batch``) and ``serving.bench``'s
(``paged-jax bench serve|throughput|latency``). Defaults are shown as they are in an environment without
``PAGED_JAX_*`` variables (some defaults read one), so the text does not depend on the machine. tests/test_cli_reference.py fails when docs/cli.md differs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Iterator

REGENERATE = "python -m serving.cli_reference > docs/cli.md"

_HEADER = f"""# Command-line reference

Generated from the argument parsers: do not edit by hand; regenerate with `{REGENERATE}`
(`tests/test_cli_reference.py` fails when this page and the parsers disagree).

The command is `paged-jax` (`make serve` installs it as `.venv/bin/paged-jax`); `python -m serving` is
`paged-jax serve`. Flags may also be spelled with underscores (`--max_model_len`), as in vLLM; a flag not listed
here exits with status 2 naming it. Defaults are those of an environment without `PAGED_JAX_*` variables."""


@contextlib.contextmanager
def _without_paged_jax_environment() -> Iterator[None]:
    saved = {key: value for key, value in os.environ.items() if key.startswith("PAGED_JAX_")}
    for key in saved:
        del os.environ[key]
    try:
        yield
    finally:
        os.environ.update(saved)


def _parsers() -> list[tuple[str, argparse.ArgumentParser]]:
    from benchmarks.latency import build_parser as build_latency_parser
    from paged_jax.entrypoints.cli import build_generate_parser
    from serving.bench import build_serve_parser, build_throughput_parser
    from serving.cli import build_parser
    from serving.run_batch import build_run_batch_parser

    with _without_paged_jax_environment():
        return [("paged-jax serve", build_parser()), ("paged-jax generate", build_generate_parser()),
                ("paged-jax run-batch", build_run_batch_parser()),
                ("paged-jax bench serve", build_serve_parser()),
                ("paged-jax bench throughput", build_throughput_parser()),
                ("paged-jax bench latency", build_latency_parser())]


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _code(value: object) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return f"`{text}`" if text else '`""`'


def _flag(action: argparse.Action) -> str:
    if not action.option_strings:
        return f"`{action.metavar or action.dest}`"
    return ", ".join(f"`{option}`" for option in action.option_strings)


def _value(action: argparse.Action) -> str:
    """What the flag takes: nothing (a switch), one of its choices, or its metavar (several with nargs "+")."""
    if action.nargs == 0 or not action.option_strings:
        return ""
    value = " \\| ".join(_code(choice) for choice in action.choices) if action.choices is not None \
        else f"`{action.metavar or action.dest.upper()}`"
    return f"{value} ..." if action.nargs in ("+", "*") else value


def _default(action: argparse.Action) -> str:
    default = action.default
    if default is None or default == argparse.SUPPRESS:
        return ""
    if isinstance(default, bool):
        return "on" if default else "off"
    return _code(default)


def _description(action: argparse.Action, prog: str) -> str:
    text = action.help or ""
    if "%" in text:  # argparse's own expansion of %(default)s and the like
        text = text % {**vars(action), "prog": prog}
    if action.required:
        text = f"required; {text}" if text else "required"
    return _cell(text)


def _group_rows(group: argparse._ArgumentGroup, prog: str) -> list[str]:
    return [f"| {_flag(action)} | {_value(action)} | {_default(action)} | {_description(action, prog)} |"
            for action in group._group_actions if action.dest != "help"]


def cli_reference() -> str:
    """The Markdown of docs/cli.md (ends with one newline)."""
    lines = [_HEADER]
    rendered: dict[tuple[str, tuple[str, ...]], str] = {}  # (group title, rows) -> the command that listed it
    for command, parser in _parsers():
        lines += ["", f"## `{command}`"]
        if parser.description:
            lines += ["", parser.description]
        for group in parser._action_groups:
            rows = _group_rows(group, parser.prog)
            if not rows:
                continue
            title = group.title or "options"
            lines += ["", f"### {title[0].upper()}{title[1:]}", ""]
            key = (title, tuple(rows))
            if key in rendered:
                lines.append(f"The same flags as `{rendered[key]}`'s (above).")
                continue
            rendered[key] = command
            lines += ["| flag | value | default | description |", "|---|---|---|---|", *rows]
    return "\n".join(lines) + "\n"


def main() -> int:
    sys.stdout.write(cli_reference())
    return 0


if __name__ == "__main__":
    sys.exit(main())
