"""The first minutes with ``paged-jax serve``: a bad flag value is refused before anything loads,
``--uvicorn-log-level`` reaches uvicorn, and a signal during start-up leaves no process behind. (Flags that cannot
act here warn once each: tests/test_cli.py.)"""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def no_engine(monkeypatch):
    """Fails the test if an engine (in this process or its own) is constructed."""
    import paged_jax.engine.llm_engine
    import serving.engine_process

    def built(*args, **kwargs):
        raise AssertionError("the engine was constructed")

    monkeypatch.setattr(paged_jax.engine.llm_engine, "LLMEngine", built)
    monkeypatch.setattr(serving.engine_process, "start_engine_process", built)


@pytest.mark.parametrize("argv, named", [
    (["--enable-lora", "--lora-modules", "sql=/no/such/adapter/dir"], "--lora-modules sql"),
    (["--enable-lora", "--lora-modules", '{"name": "sql", "path": "./missing-adapter"}'], "--lora-modules sql"),
    (["--chat-template", "/no/such/template.jinja"], "--chat-template"),
    (["--chat-template", "{% for message in messages %}{{ message.content }}"], "--chat-template"),  # no endfor
    (["--tokenizer", "/no/such/tokenizer/dir"], "--tokenizer"),
    (["--tool-call-parser", "no-such-parser"], "--tool-call-parser"),
    (["--reasoning-parser", "no-such-parser"], "--reasoning-parser"),
])
def test_bad_file_and_name_flags_exit_2_before_the_engine_is_built(argv, named, no_engine, capsys):
    from serving.commands import main

    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--port", "0", *argv])
    assert exit_info.value.code == 2
    assert named in capsys.readouterr().err


def test_uvicorn_log_level_reaches_uvicorns_loggers(caplog):
    """``--uvicorn-log-level debug`` lets uvicorn's debug records through its handlers (``info``, the default, does
    not); ``trace`` shows uvicorn's per-connection lines on a real request."""
    from serving.cli import parse_serve_args
    from serving.settings import uvicorn_config

    def records_at(level_flag: str, emit) -> list[str]:
        _, args = parse_serve_args(["--uvicorn-log-level", level_flag, "--host", "127.0.0.1", "--port", "0"])
        config = uvicorn_config(_hello_app, args)
        uvicorn_logger = logging.getLogger("uvicorn")  # uvicorn's own handler: records do not reach the root
        uvicorn_logger.addHandler(caplog.handler)
        caplog.clear()
        try:
            emit(config)
        finally:
            uvicorn_logger.removeHandler(caplog.handler)
        return [r.getMessage() for r in caplog.records]

    def debug_line(config) -> None:
        logging.getLogger("uvicorn.error").debug("a uvicorn debug line")

    assert records_at("debug", debug_line) == ["a uvicorn debug line"]
    assert records_at("info", debug_line) == []
    assert any("HTTP connection made" in line for line in records_at("trace", _serve_one_request))


async def _hello_app(scope, receive, send):
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"hello"})


def _serve_one_request(config) -> None:
    import threading

    import uvicorn

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        server = uvicorn.Server(config)
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        assert httpx.get(f"http://127.0.0.1:{sock.getsockname()[1]}/").text == "hello"
        server.should_exit = True
        thread.join(timeout=30)



def _descendants(pid: int) -> set[int]:
    """The live (not zombie) descendants of ``pid``, from /proc."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z":
                parents[int(entry.name)] = int(fields[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _as_from_a_terminal() -> None:
    """In the server's child before exec: SIGINT handled by default and not blocked, as a shell starts a command; an
    ignored or blocked SIGINT would otherwise pass from the test process (whatever ran in it before) to the server,
    and Python installs its Ctrl-C handler only where SIGINT is not ignored."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_during_start_up_ends_every_child_process(smollm2_dir, sig, tmp_path):
    """``python -m serving`` with the built-in model, signalled once its engine process is loading / compiling (before
    /health answers): the server and every process it started are gone within 5 s."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    log = tmp_path / "server.log"
    with open(log, "w") as stderr:
        # An empty compilation cache directory: the start compiles, so the signal comes mid start-up.
        server = subprocess.Popen(
            [sys.executable, "-m", "serving", "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "256",
             "--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--compilation-cache-dir",
             str(tmp_path / "cache")], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=stderr,
            preexec_fn=_as_from_a_terminal)
    try:
        deadline = time.monotonic() + 300
        while "engine process started" not in log.read_text():
            assert server.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        time.sleep(1.0)  # the engine process is importing / loading by now
        children = _descendants(server.pid)
        engine_pid = int(re.search(r"engine process started \(pid (\d+)\)", log.read_text()).group(1))
        assert engine_pid in children
        with pytest.raises(httpx.HTTPError):  # not ready: the socket is bound but nothing answers yet
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=0.5)
        server.send_signal(sig)
        deadline = time.monotonic() + 5
        while (server.poll() is None or any(_alive(pid) for pid in children)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.poll() == 0, log.read_text()[-3000:]
        assert not [pid for pid in children if _alive(pid)], log.read_text()[-3000:]
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


# CI time: signal handling stays in CI through test_serve_exit_status; this adds background compilation to it.
@pytest.mark.slow
def test_sigterm_while_executables_compile_in_the_background_ends_every_process(smollm2_dir, tmp_path):
    """``python -m serving`` with the built-in model and an empty compilation cache answers a completion while the
    rest of its step executables compile in the background; SIGTERM then ends the server and every process it
    started within 5 s, exit status 0 (the engine process does not wait for the compiles in flight, nor dies in
    one)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    log = tmp_path / "server.log"
    with open(log, "w") as stderr:
        server = subprocess.Popen(
            [sys.executable, "-m", "serving", "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "256",
             "--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--background-compilation",
             "--compilation-cache-dir", str(tmp_path / "cache")], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
            stderr=stderr)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert server.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            try:
                response = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                                      json={"model": "SmolLM2-135M-Instruct", "prompt": "Hi", "max_tokens": 2})
            except httpx.HTTPError:
                time.sleep(0.1)
                continue
            assert response.status_code == 200, response.text
            break
        text = log.read_text()
        assert "in the background" in text and "step executables ready" not in text, text[-3000:]
        children = _descendants(server.pid)
        server.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 5
        while (server.poll() is None or any(_alive(pid) for pid in children)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.poll() == 0, log.read_text()[-3000:]
        assert not [pid for pid in children if _alive(pid)], log.read_text()[-3000:]
        assert "terminate called" not in log.read_text()  # no thread died inside a compile at the engine's exit
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
