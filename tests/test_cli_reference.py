"""docs/cli.md is the flag reference generated from the argument parsers (serving.cli_reference)."""

import difflib
from pathlib import Path

import pytest

from serving.cli_reference import REGENERATE, cli_reference

ROOT = Path(__file__).resolve().parents[1]


def test_docs_cli_md_matches_the_parsers():
    expected = cli_reference()
    actual = (ROOT / "docs" / "cli.md").read_text()
    if actual != expected:
        diff = "".join(list(difflib.unified_diff(actual.splitlines(True), expected.splitlines(True),
                                                 "docs/cli.md", "generated"))[:60])
        pytest.fail(f"docs/cli.md is out of date with the argument parsers; regenerate it with `{REGENERATE}`\n{diff}")


def test_reference_lists_every_flag_of_every_command():
    from benchmarks.latency import build_parser as build_latency_parser
    from paged_jax.entrypoints.cli import build_generate_parser
    from serving.bench import build_serve_parser, build_throughput_parser
    from serving.cli import build_parser

    text = cli_reference()
    for parser in (build_parser(), build_generate_parser(), build_serve_parser(), build_throughput_parser(),
                   build_latency_parser()):
        for action in parser._actions:
            for option in action.option_strings:
                if option not in ("-h", "--help"):
                    assert f"`{option}`" in text, option


def test_defaults_do_not_depend_on_the_environment(monkeypatch):
    expected = cli_reference()
    monkeypatch.setenv("PAGED_JAX_API_KEY", "secret-from-the-environment")
    text = cli_reference()
    assert text == expected and "secret-from-the-environment" not in text
