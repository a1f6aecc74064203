"""Every ``bash`` / ``shell`` / ``python`` code block of README.md and docs/*.md runs as written, on the CPU with the
built-in model.

Convention (an HTML comment on the line just above the opening fence; invisible on GitHub):

* ``<!-- docs-test: skip REASON -->``: the block is not run; REASON (required) says what it needs that a CPU test
  machine lacks: a GPU, the network (pip, the Hub), a long-running server, docker / kubectl, a LoRA adapter.
* ``<!-- docs-test: slow -->``: the block runs only with the ``slow`` tests (``make test-all``).
* ``<!-- docs-test: server -->``: a python block that talks to the server a block above starts: it runs against a
  server of the built-in model (its ``openai.OpenAI`` clients are pointed at it instead of localhost:8000).

Python blocks run in this process, in a fresh namespace, with ``paged_jax.LLM`` given short engine settings the
block does not set itself (the shared ``serving_engine``'s, so its compiled executables are reused): what they
change is only how many step shapes are compiled, not what the example does. Shell blocks run with ``bash -e`` from
the repository root, with the interpreter's ``bin`` directory (``paged-jax``) first on PATH. Blocks of other
languages (``text``, ``json``, ``yaml``, ...) are not code to run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUN_LANGUAGES = {"bash": "shell", "sh": "shell", "shell": "shell", "python": "python"}
# Engine settings a python block's LLM(...) gets unless it sets them (tests/conftest.py's serving_engine).
SHORT_ENGINE_SETTINGS = dict(dtype="float32", max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64,
                             num_gpu_blocks_override=80)
_FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.M | re.S)
_MARKER = re.compile(r"<!--\s*docs-test:\s*(skip|slow|server)\b\s*(.*?)\s*-->\s*$")
DOCUMENTED_BASE_URL = "http://localhost:8000/v1"


def doc_blocks() -> list:
    """One pytest param per runnable block: (language, code, marker, reason), id ``FILE:LINE``."""
    params = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text()
        for match in _FENCE.finditer(text):
            language = RUN_LANGUAGES.get(match.group(1))
            if language is None:
                continue
            line = text.count("\n", 0, match.start()) + 1
            previous = text[:match.start()].rstrip("\n").rsplit("\n", 1)[-1]
            marker = _MARKER.search(previous)
            kind, reason = (marker.group(1), marker.group(2)) if marker else (None, "")
            marks = [pytest.mark.slow] if kind == "slow" else []
            params.append(pytest.param(language, match.group(2), kind, reason, marks=marks,
                                       id=f"{path.relative_to(ROOT)}:{line}"))
    return params


def test_skip_markers_give_a_reason():
    for param in doc_blocks():
        _, _, kind, reason = param.values
        assert kind != "skip" or reason, f"{param.id}: docs-test: skip needs a reason"


@pytest.fixture(scope="module")
def short_llm_engines():
    """The engines the python blocks built, kept for the module (``short_llm``)."""
    return {}


@pytest.fixture
def short_llm(monkeypatch, short_llm_engines):
    """``paged_jax.LLM`` with ``SHORT_ENGINE_SETTINGS`` as defaults; one engine per distinct argument set, shared by
    the blocks (as one notebook session would)."""
    import paged_jax

    from paged_jax.config import EngineArgs

    engines = short_llm_engines
    real_llm = paged_jax.LLM
    defaults = EngineArgs()

    def short(model=None, **kwargs):
        # An argument given at its default value builds the same engine as one left out: the engine is shared.
        kwargs = {**SHORT_ENGINE_SETTINGS,
                  **{name: value for name, value in kwargs.items() if getattr(defaults, name, object()) != value}}
        key = (model, tuple(sorted((k, repr(v)) for k, v in kwargs.items())))
        if key not in engines:
            engines[key] = real_llm(model, **kwargs)
        return engines[key]

    monkeypatch.setattr(paged_jax, "LLM", short)
    return short


@pytest.fixture(scope="module")
def docs_server(serving_engine):
    """A server of the built-in model under the name ``paged-jax serve`` gives it (``serving.app.create_app`` over
    the shared ``serving_engine``)."""
    from serving.app import create_app
    from serving.openai_server import DEFAULT_MODEL_NAME
    from tests.test_serving import ServerThread

    with ServerThread(create_app(serving_engine, served_model_name=[DEFAULT_MODEL_NAME])) as server:
        yield server


@pytest.fixture
def redirected_openai(request, monkeypatch):
    """For ``server`` blocks: ``openai.OpenAI`` clients made for localhost:8000 talk to ``docs_server``."""
    import openai

    server = request.getfixturevalue("docs_server")
    real_client = openai.OpenAI

    def client(*args, base_url=None, **kwargs):
        assert base_url == DOCUMENTED_BASE_URL, base_url
        return real_client(*args, base_url=server.base_url + "/v1", **kwargs)

    monkeypatch.setattr(openai, "OpenAI", client)


@pytest.mark.parametrize("language, code, kind, reason", doc_blocks())
def test_doc_block_runs(language, code, kind, reason, short_llm, smollm2_dir, request):
    if kind == "skip":
        pytest.skip(reason)
    if kind == "server":
        request.getfixturevalue("redirected_openai")
    if language == "python":
        exec(compile(code, "<doc block>", "exec"), {"__name__": "__doc_block__"})
        return
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu",
           "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}
    run = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", code], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=900)
    assert run.returncode == 0, f"exit status {run.returncode}\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
