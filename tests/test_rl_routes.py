"""The RL trainer's server routes (serving/routes/rl.py) on an engine core in its own process: mounted only in dev
mode; weight updates from disk, sleep / wake_up, pause / resume go through the core's utility calls."""

import httpx
import pytest

from models.testing import save_random_hf_checkpoint, tiny_config
from paged_jax.config import EngineArgs

ENGINE = dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64,
              num_gpu_blocks_override=16, weight_cache=False, enable_sleep_mode=True)
PROMPT = [3, 14, 15, 92, 65]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("rl_routes")
    return (save_random_hf_checkpoint(tiny_config("llama"), root / "a", seed=0),
            save_random_hf_checkpoint(tiny_config("llama"), root / "b", seed=1))


def _complete(base_url):
    """The greedy completion's tokens (the checkpoint has no tokenizer: logprob tokens as ids)."""
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 6, "temperature": 0.0, "logprobs": 0,
            "return_tokens_as_token_ids": True}
    response = httpx.post(base_url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["logprobs"]["tokens"]


def test_rl_routes_on_a_process_core(checkpoints, monkeypatch):
    from serving.app import create_app, mounted_routers
    from serving.routes import rl
    from serving.engine_process import start_engine_process
    from tests.test_serving import ServerThread

    path_a, path_b = checkpoints
    monkeypatch.delenv("VLLM_SERVER_DEV_MODE", raising=False)
    assert rl.router not in mounted_routers()
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    assert rl.router in mounted_routers()
    app = create_app(start_engine_process(EngineArgs(model=str(path_a), **ENGINE), start_timeout=300),
                     served_model_name="tiny")
    try:
        with ServerThread(app) as server:
            url = server.base_url
            text_a = _complete(url)
            response = httpx.post(url + "/update_weights_from_disk", json={"model_path": str(path_b)}, timeout=60)
            assert response.status_code == 200 and response.json()["success"] is True
            text_b = _complete(url)
            assert text_b != text_a
            response = httpx.post(url + "/update_weights_from_disk", json={"model_path": str(path_b / "none")})
            assert response.status_code == 400 and "not a directory" in response.json()["error"]["message"]
            assert _complete(url) == text_b  # the old weights keep serving
            response = httpx.post(url + "/init_weight_transfer_engine", json={"init_info": {"trainer_process": 1}})
            assert response.status_code == 400 and "weight_transfer_config" in response.json()["error"]["message"]
            response = httpx.post(url + "/update_weights", json={"update_info": {
                "names": ["lm_head.weight"], "dtype_names": ["float32"], "shapes": [[256, 64]]}})
            assert response.status_code == 400
            assert "call init_weight_transfer_engine first" in response.json()["error"]["message"]

            assert httpx.post(url + "/sleep", params={"level": 1}, timeout=60).status_code == 200
            assert httpx.get(url + "/is_sleeping").json() == {"is_sleeping": True}
            assert httpx.post(url + "/wake_up", params={"tags": ["kv"]}).status_code == 400
            assert httpx.post(url + "/wake_up", params={"tags": ["weights", "kv_cache"]}).status_code == 200
            assert httpx.get(url + "/is_sleeping").json() == {"is_sleeping": False}
            assert _complete(url) == text_b

            assert httpx.post(url + "/pause", params={"mode": "keep"}).status_code == 200
            assert httpx.get(url + "/is_paused").json() == {"is_paused": True}
            assert httpx.post(url + "/pause", params={"mode": "later"}).status_code == 400
            assert httpx.post(url + "/resume").status_code == 200
            assert httpx.get(url + "/is_paused").json() == {"is_paused": False}
            assert _complete(url) == text_b
    finally:
        app.state.server.engine.shutdown()
