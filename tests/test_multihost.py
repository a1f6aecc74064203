"""A multi-host engine (paged_jax.parallel.multihost) as two local CPU processes: `paged-jax serve --nnodes 2`,
tp = 2 across the two "hosts" (one device each, gloo collectives), node 0 serving HTTP; one completion request
gives the single-device greedy tokens, and node 0's shutdown ends node 1 cleanly. A node killed (kill -9) makes the
other one log it and exit with status 1 within seconds (paged_jax.parallel.rank_watch; the watch itself is tested
in one process with a fake key-value store)."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from tests.test_data_parallel import MAX_TOKENS, qwen3_checkpoint_in, transformers_greedy

REPO_ROOT = Path(__file__).resolve().parents[1]
PROMPT = [5, 6, 7, 8, 9, 10, 11]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    """One random Qwen3 checkpoint for every two-node launch here."""
    return qwen3_checkpoint_in(tmp_path_factory.mktemp("qwen3"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


class _TwoNodes:
    """``paged-jax serve CHECKPOINT --nnodes 2 -tp 2`` as two local processes (node 0 on ``http_port``), their
    output in ``tmp_path/node<R>.log``."""

    def __init__(self, tmp_path, checkpoint: str, *extra_flags: str):
        self.tmp_path = tmp_path
        coordinator, self.http_port = _free_port(), _free_port()
        env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1",
                   PYTHONPATH=str(REPO_ROOT), PYTHONUNBUFFERED="1")
        common = [sys.executable, "-m", "serving", checkpoint, "--nnodes", "2", "--master-addr", "127.0.0.1",
                  "--master-port", str(coordinator), "-tp", "2", "--max-model-len", "64", "--max-num-seqs", "2",
                  "--max-num-batched-tokens", "16", "--num-gpu-blocks-override", "24", "--disable-log-stats",
                  *extra_flags]
        self.logs = [open(tmp_path / f"node{rank}.log", "w+") for rank in range(2)]
        self.nodes = [subprocess.Popen(common + ["--node-rank", str(rank)]
                                       + (["--host", "127.0.0.1", "--port", str(self.http_port)] if rank == 0 else []),
                                       env=env, cwd=str(REPO_ROOT), stdout=self.logs[rank], stderr=subprocess.STDOUT)
                      for rank in range(2)]

    def log(self, rank: int) -> str:
        self.logs[rank].flush()
        return (self.tmp_path / f"node{rank}.log").read_text()

    def tails(self) -> str:
        return "\n".join(f"--- node {rank}:\n" + self.log(rank)[-3000:] for rank in range(2))

    def wait_for(self, ready, what: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            if any(node.poll() is not None for node in self.nodes):
                pytest.fail(f"a node exited before {what}:\n" + self.tails())
            if time.monotonic() > deadline:
                pytest.fail(f"no {what} within {timeout} s:\n" + self.tails())
            time.sleep(0.2)

    def wait_exit(self, rank: int, timeout: float) -> int:
        try:
            return self.nodes[rank].wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"node {rank} did not exit within {timeout} s:\n" + self.tails())

    def kill_all(self) -> None:
        for node in self.nodes:
            if node.poll() is None:
                node.kill()
                node.wait()


def _serving(two_nodes: _TwoNodes) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{two_nodes.http_port}/health", timeout=5) as response:
            return response.status == 200
    except OSError:
        return False


def test_two_nodes_tensor_parallel_serve_matches_single_device(tmp_path, checkpoint):
    reference = transformers_greedy(checkpoint, [PROMPT])[0]
    two_nodes = _TwoNodes(tmp_path, checkpoint)
    nodes, tails = two_nodes.nodes, two_nodes.tails
    http_port = two_nodes.http_port
    try:
        two_nodes.wait_for(lambda: _serving(two_nodes), "serving", timeout=600)
        body = _post(f"http://127.0.0.1:{http_port}/v1/completions",
                     {"model": str(checkpoint), "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
                      "logprobs": 0, "return_tokens_as_token_ids": True})
        tokens = [int(t.split(":")[1]) for t in body["choices"][0]["logprobs"]["tokens"]]
        assert tokens == reference, tails()
    finally:
        nodes[0].terminate()  # node 0 shuts down (SIGTERM: uvicorn's graceful exit), then tells node 1 to stop
        try:
            codes = [node.wait(timeout=120) for node in nodes]
        except subprocess.TimeoutExpired:
            for node in nodes:
                node.kill()
            pytest.fail("the nodes did not exit after node 0's shutdown:\n" + tails())
    assert codes[1] == 0, tails()
    assert "node 0 shut down; node 1 exits" in two_nodes.log(1)
    assert "is gone" not in two_nodes.log(0) + two_nodes.log(1), tails()  # a clean exit is no death


# CI time: the follower's death (killed = 1) runs with the slow tests; node 0's stays in CI.
@pytest.mark.parametrize("killed", [pytest.param(1, marks=pytest.mark.slow), 0])
def test_a_killed_node_makes_the_other_exit_with_an_error_naming_it(tmp_path, checkpoint, killed):
    """kill -9 of either node once both watch each other (their engines are still loading / compiling; serving
    makes no difference to the watch): the survivor logs the dead node and exits with status 1 within seconds, long
    before JAX's heartbeat (3 x --distributed-timeout-seconds = 24 s) would abort it. Node 0 is killed in its engine process, the JAX process that also
    hosts the coordinator (its API server then exits 1 too); node 1 in its main process (its engine process follows
    it)."""
    two_nodes = _TwoNodes(tmp_path, checkpoint, "--distributed-timeout-seconds", "8")
    survivor = 1 - killed
    try:
        two_nodes.wait_for(lambda: all(f"node {r} watches node(s) [{1 - r}] (--distributed-timeout-seconds 8)"
                                       in two_nodes.log(r) for r in range(2)), "watch connection", timeout=120)
        if killed == 0:
            os.kill(int(re.search(r"engine process started \(pid (\d+)\)", two_nodes.log(0)).group(1)),
                    signal.SIGKILL)
        else:
            two_nodes.nodes[1].kill()
        codes = [two_nodes.wait_exit(rank, timeout=20) for rank in range(2)]
    finally:
        two_nodes.kill_all()
    assert codes[survivor] == 1, two_nodes.tails()
    assert f"node {killed} is gone: " in two_nodes.log(survivor), two_nodes.tails()
    if killed == 1:
        assert codes[0] == 1  # the API server, its engine process gone
        assert "Terminating process because the JAX distributed service" not in two_nodes.log(0)


# ------------------------------------------------------------------ dead nodes (paged_jax.parallel.rank_watch)
class _FakeKeyValueStore:
    """The two calls of jax.distributed's client the watch makes."""

    def __init__(self):
        self._values: dict[str, str] = {}
        self._changed = threading.Condition()

    def key_value_set(self, key: str, value: str) -> None:
        with self._changed:
            self._values[key] = value
            self._changed.notify_all()

    def blocking_key_value_get(self, key: str, timeout_in_ms: int) -> str:
        with self._changed:
            assert self._changed.wait_for(lambda: key in self._values, timeout_in_ms / 1000)
            return self._values[key]


def _watches(num_nodes: int, timeout_s: float):
    """``num_nodes`` connected ``RankWatch``es of one fake job; each reports a death into its own queue."""
    from paged_jax.parallel.rank_watch import RankWatch

    store = _FakeKeyValueStore()
    reports = [queue.SimpleQueue() for _ in range(num_nodes)]
    watches = [RankWatch(store, rank, num_nodes, "127.0.0.1", timeout_s, on_dead=reports[rank].put)
               for rank in range(num_nodes)]
    starters = [threading.Thread(target=w.start) for w in watches]
    for t in starters:
        t.start()
    for t in starters:
        t.join(10)
    return watches, reports


def _kill(watch) -> None:
    """What a killed process's sockets do: end without a word."""
    for sock in watch._peers.values():
        sock.shutdown(socket.SHUT_RDWR)


def test_rank_watch_reports_a_killed_node_on_every_node_at_once():
    watches, reports = _watches(3, timeout_s=30)  # far beyond the test: end-of-file alone must do it
    node0_reports = reports[0]
    reports[1] = queue.SimpleQueue()
    watches[1]._on_dead = lambda message: (reports[1].put(message), _kill(watches[1]))  # node 1 exits on the news
    _kill(watches[2])
    assert node0_reports.get(timeout=10) == "node 2 is gone: its connection closed (the process exited or was killed)"
    assert reports[1].get(timeout=10) == ("node 2 is gone: its connection closed (the process exited or was "
                                          "killed) (reported by node 0)")
    assert node0_reports.empty()  # one report per node


def test_rank_watch_declares_a_silent_node_dead_after_the_timeout_and_ignores_clean_exits():
    from paged_jax.config import EngineArgs

    with pytest.raises(ValueError, match="distributed_timeout_seconds must be >= 1"):
        EngineArgs(distributed_timeout_seconds=0)
    watches, reports = _watches(2, timeout_s=1)
    watches[1].close()  # node 1 leaves cleanly: says bye, then its connection ends
    _kill(watches[1])
    time.sleep(1.5)  # past the timeout: nothing is reported for a clean exit
    assert reports[0].empty() and reports[1].empty()

    watches, reports = _watches(2, timeout_s=1)
    watches[1]._on_dead = lambda message: None
    with watches[1]._lock:
        watches[1]._dead_reported = True  # node 1's pings stop (a hung or vanished host)
    assert reports[0].get(timeout=5).startswith("node 1 is gone: no message from it for 1 s")


def test_a_follower_aborted_by_jax_reports_node_0_gone(caplog):
    """When node 0 is killed, JAX may abort a follower's engine process (the coordinator is gone) before that
    process's own watch logs anything: the follower's parent reports it (here the child aborts, and nothing
    listens on the coordinator's port)."""
    from paged_jax.parallel.rank_watch import run_supervised

    closed_port = _free_port()
    with caplog.at_level("ERROR"):
        assert run_supervised(os.abort, (), f"127.0.0.1:{closed_port}", 1) == 1
    assert f"node 0 is gone: the coordinator at 127.0.0.1:{closed_port} does not answer" in caplog.text


_AGREE_SCRIPT = """
import sys
import jax
rank, port = int(sys.argv[1]), sys.argv[2]
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=rank)
from paged_jax.parallel.multihost import agree_on_smallest
if rank == 1:
    import time
    time.sleep(2)  # node 0 waits for the late node's value
print(agree_on_smallest("num_gpu_blocks", 100 + 10 * rank), agree_on_smallest("num_gpu_blocks", 50 - rank),
      flush=True)
jax.distributed.shutdown()
"""


def test_nodes_agree_on_the_smallest_block_count():
    """Each node sizes its KV pool from its own devices; the block count is a compiled shape, so every node takes
    the smallest (which fits them all), once per call, whichever node computes first."""
    port = _free_port()
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    nodes = [subprocess.Popen([sys.executable, "-c", _AGREE_SCRIPT, str(rank), str(port)], env=env,
                              cwd=str(REPO_ROOT), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in (0, 1)]
    outputs = [node.communicate(timeout=120) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], [err[-2000:] for _, err in outputs]
    assert [out.split() for out, _ in outputs] == [["100", "49"], ["100", "49"]]
    assert "using the smallest" in outputs[1][1] and "using the smallest" in outputs[0][1]
