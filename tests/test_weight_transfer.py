"""Weights from a trainer in another process of the same JAX job (paged_jax.parallel.weight_transfer): two local CPU
processes of one jax.distributed job (gloo collectives), the engine in one (``weight_transfer_config={"backend":
"jax"}``), the trainer in the other holding checkpoint B's parameters; after ``update_weights_from_distributed`` the
engine (tensor parallel, on its own process's devices) generates what it generates from B's checkpoint on disk,
without a compile; a transfer whose shapes do not fit is refused on both sides before any collective, and the engine
keeps serving."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from models.testing import save_random_hf_checkpoint, tiny_config
from paged_jax.config import EngineArgs
from tests.test_multihost import REPO_ROOT, _free_port

_SCRIPT = """
import sys
from paged_jax.parallel.mesh import initialize_distributed
rank, port, ckpt_a, ckpt_b, tp = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
initialize_distributed(f"127.0.0.1:{port}", 2, rank)
import jax
from flax import nnx
from models.loader import load_model
from paged_jax.parallel.weight_transfer import metadata, send_weights
from paged_jax.worker.weight_update import flatten_named

params = flatten_named(nnx.state(load_model(ckpt_b, dtype="float32")[0]))
wrong = dict(params)
name = next(iter(wrong))
wrong[name] = wrong[name][..., :1]
if rank == 0:  # the trainer
    send_weights(params, engine_process=1)
    try:
        send_weights(wrong, engine_process=1)
    except RuntimeError as exc:
        print("TRAINER REFUSED:", exc, flush=True)
else:  # the engine
    from paged_jax import LLM, SamplingParams
    llm = LLM(model=ckpt_a, weight_transfer_config={"backend": "jax"}, tensor_parallel_size=tp, dtype="float32",
              max_model_len=64,
              max_num_seqs=2, max_num_batched_tokens=16, num_gpu_blocks_override=16, weight_cache=False,
              use_tqdm=False)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    def tokens():
        return list(llm.generate([{"prompt_token_ids": [3, 17, 42, 99, 7]}], greedy, use_tqdm=False)[0]
                    .outputs[0].token_ids)
    tokens_a = tokens()
    llm.update_weights_from_disk(ckpt_b)
    tokens_b = tokens()
    llm.update_weights_from_disk(ckpt_a)
    llm.init_weight_transfer_engine({"trainer_process": 0})
    llm.update_weights_from_distributed(**metadata(params))
    print("ENGINE", tokens_a != tokens_b, tokens() == tokens_b, flush=True)
    try:
        llm.update_weights_from_distributed(**metadata(params))
    except ValueError as exc:
        print("ENGINE REFUSED:", exc, flush=True)
    runner = llm.llm_engine.engine_core.runner
    own = {d.process_index for leaf in runner.param_leaves for d in leaf.sharding.device_set} == {1}
    print("ENGINE AFTER", tokens() == tokens_b, own, runner.num_compiles_since_warmup, flush=True)
jax.distributed.shutdown()
"""


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpts")
    return [str(save_random_hf_checkpoint(tiny_config("llama"), root / name, seed=seed))
            for name, seed in (("a", 0), ("b", 1))]


def test_a_trainer_process_sends_the_engine_its_weights_through_a_collective(checkpoints):
    """The engine is tensor parallel (tp = 2; one device takes the same path, its transform checked in process by
    tests/test_weight_update.py): it runs on its own process's devices, never the trainer's, and the received weights
    land in its shards."""
    tp = 2
    port = _free_port()
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_force_host_platform_device_count={tp}",
           "PYTHONPATH": str(REPO_ROOT)}
    nodes = [subprocess.Popen([sys.executable, "-c", _SCRIPT, str(rank), str(port), *checkpoints, str(tp)], env=env,
                              cwd=str(REPO_ROOT), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in (0, 1)]
    try:
        outputs = [node.communicate(timeout=300) for node in nodes]
    finally:
        for node in nodes:  # a hung collective: end both processes
            node.kill()
    assert [node.returncode for node in nodes] == [0, 0], [err[-3000:] for _, err in outputs]
    trainer, engine = outputs[0][0], outputs[1][0]
    assert "ENGINE True True" in engine  # B's weights differ from A's, and the engine now generates B's tokens
    assert "ENGINE REFUSED: update_weights_from_distributed: names / dtype_names / shapes differ" in engine
    assert "TRAINER REFUSED: the engine refused the weights: error: update_weights_from_distributed" in trainer
    assert "ENGINE AFTER True True 0" in engine  # still B's weights, on the engine's devices; no compile


def test_weight_transfer_config_is_checked():
    assert EngineArgs(weight_transfer_config='{"backend": "jax"}').weight_transfer_config == {"backend": "jax"}
    with pytest.raises(ValueError, match="^weight_transfer_config must be"):
        EngineArgs(weight_transfer_config={"backend": "nccl"})
    with pytest.raises(ValueError, match="^data_parallel_size must be 1 with weight_transfer_config"):
        EngineArgs(weight_transfer_config={"backend": "jax"}, data_parallel_size=2)
