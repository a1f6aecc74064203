"""The exit status of the real ``serve`` command (issue 53): 0 after a graceful drain on SIGTERM or SIGINT (what a
supervisor or Kubernetes reads as a clean stop), 1 after a failure (the engine process died).

Each case runs the CLI in a subprocess, as deployed: ``python -m serving`` (the engine in its own process) and
the ``paged-jax serve`` console entry point (the engine on a thread), over a tiny model config with dummy weights
(no checkpoint, no tokenizer: token-id prompts). The three servers start together, so their start-ups (imports,
compiles) overlap.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from tests.test_serving import wait_until

REPO = Path(__file__).resolve().parents[1]
ENGINE_FLAGS = ["--load-format", "dummy", "--dtype", "float32", "--max-model-len", "128", "--max-num-seqs", "4",
                "--max-num-batched-tokens", "64", "--disable-uvicorn-access-log"]
# python -m serving, and the console script's own code (`paged-jax = "serving.commands:main"`) under this interpreter.
# The console script runs its engine on a thread (--no-engine-process), so both placements are covered.
COMMANDS = {"module": ["-m", "serving"],
            "console script": ["-c", "import sys; from serving.commands import main; sys.exit(main())", "serve",
                               "--no-engine-process"]}
CASES = {"SIGTERM": "module", "SIGINT": "console script", "engine death": "module"}


class Served:
    """One ``serve`` subprocess on a free port, its output in ``log``."""

    def __init__(self, command: list[str], model_dir: str, log: Path) -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{port}"
        self.log = log
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
        with open(log, "w") as out:
            self.process = subprocess.Popen(
                [sys.executable, *command, model_dir, *ENGINE_FLAGS, "--host", "127.0.0.1", "--port", str(port),
                 "--shutdown-timeout", "60"], cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)

    def output(self) -> str:
        return self.log.read_text()

    def healthy(self) -> bool:
        assert self.process.poll() is None, self.output()
        try:
            return httpx.get(self.base_url + "/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    from models.testing import tiny_config

    model_dir = tmp_path_factory.mktemp("tiny")
    (model_dir / "config.json").write_text(json.dumps(tiny_config("llama", max_position_embeddings=128)))
    started = {case: Served(COMMANDS[command], str(model_dir), model_dir / f"{command}-{case}.log")
               for case, command in CASES.items()}
    try:
        for served in started.values():
            assert wait_until(served.healthy, timeout=300, interval=0.25), served.output()
        yield started
    finally:
        for served in started.values():
            if served.process.poll() is None:
                served.process.kill()
                served.process.wait(30)


def _stream(base_url: str, events: list[str]) -> None:
    body = {"prompt": [1, 2, 3], "max_tokens": 60, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=120) as response:
        events.extend(line[len("data: "):] for line in response.iter_lines() if line.startswith("data: "))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_graceful_drain_exits_0(servers, sig):
    """A stream running when the signal comes finishes whole (--shutdown-timeout 60), then the server exits 0."""
    served = servers[sig.name]
    events: list[str] = []
    reader = threading.Thread(target=_stream, args=(served.base_url, events), daemon=True)
    reader.start()
    assert wait_until(lambda: len(events) >= 2, timeout=60), served.output()
    served.process.send_signal(sig)
    assert served.process.wait(120) == 0, served.output()
    reader.join(timeout=30)
    assert events[-1] == "[DONE]", events[-3:]
    chunks = [json.loads(event) for event in events[:-1]]
    assert not any("error" in chunk for chunk in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert sum(1 for chunk in chunks if chunk["choices"] and chunk["choices"][0]["finish_reason"] is None) >= 1


def test_engine_death_exits_1(servers):
    served = servers["engine death"]
    engine_pid = int(re.search(r"engine process started \(pid (\d+)\)", served.output()).group(1))
    os.kill(engine_pid, signal.SIGKILL)
    assert served.process.wait(120) == 1, served.output()
