"""A multi-host engine (paged_jax.parallel.multihost) as two local CPU processes: `paged-jax serve --nnodes 2`,
tp = 2 across the two "hosts" (one device each, gloo collectives), node 0 serving HTTP; one completion request
gives the single-device greedy tokens, and node 0's shutdown ends node 1 cleanly."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.test_data_parallel import MAX_TOKENS, qwen3_checkpoint_in, transformers_greedy

REPO_ROOT = Path(__file__).resolve().parents[1]
PROMPT = [5, 6, 7, 8, 9, 10, 11]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def test_two_nodes_tensor_parallel_serve_matches_single_device(tmp_path):
    checkpoint = qwen3_checkpoint_in(tmp_path)
    reference = transformers_greedy(checkpoint, [PROMPT])[0]
    coordinator, http_port = _free_port(), _free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1",
               PYTHONPATH=str(REPO_ROOT), PYTHONUNBUFFERED="1")
    common = [sys.executable, "-m", "serving", str(checkpoint), "--nnodes", "2", "--master-addr", "127.0.0.1",
              "--master-port", str(coordinator), "-tp", "2", "--max-model-len", "64", "--max-num-seqs", "2",
              "--max-num-batched-tokens", "16", "--num-gpu-blocks-override", "24", "--disable-log-stats"]
    logs = [open(tmp_path / f"node{rank}.log", "w+") for rank in range(2)]
    nodes = [subprocess.Popen(common + ["--node-rank", str(rank)]
                              + (["--host", "127.0.0.1", "--port", str(http_port)] if rank == 0 else []),
                              env=env, cwd=str(REPO_ROOT), stdout=logs[rank], stderr=subprocess.STDOUT)
             for rank in range(2)]

    def tails() -> str:
        out = []
        for rank, log in enumerate(logs):
            log.flush()
            out.append(f"--- node {rank}:\n" + (tmp_path / f"node{rank}.log").read_text()[-3000:])
        return "\n".join(out)

    try:
        deadline = time.monotonic() + 600
        while True:
            if any(node.poll() is not None for node in nodes):
                pytest.fail("a node exited before serving:\n" + tails())
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/health", timeout=5) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("the two-node server did not come up:\n" + tails())
            time.sleep(1)
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
    assert "node 0 shut down; node 1 exits" in (tmp_path / "node1.log").read_text()
