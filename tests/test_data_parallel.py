"""Data parallelism (paged_jax.parallel.data_parallel): replicas on their own devices give the single-device engine's greedy
output, the router sends a repeated prefix to the replica that caches it, stats and metrics per replica.

Small settings (few tokens, 2 sequences per step) keep the engine builds cheap; the CPU has 8 fake devices
(tests/conftest.py)."""

from __future__ import annotations

import pytest

from models.testing import save_random_hf_checkpoint, tiny_config
from paged_jax.config import EngineArgs
from paged_jax.engine.core import EngineCore
from paged_jax.engine.llm_engine import LLMEngine
from paged_jax.parallel.data_parallel import DataParallelCore
from paged_jax.sampling_params import SamplingParams

SMALL = dict(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16, num_gpu_blocks_override=24, block_size=8,
             seed=0)
QWEN3_PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [40, 41, 42, 43, 44, 45, 46] * 3]
SMOLLM2_PROMPTS = [[1, 504, 3458, 282, 4055, 314, 216, 1345], [1, 9519, 28], [1, 30, 2, 9519, 28, 42, 17, 99] * 2]
MAX_TOKENS = 5


def greedy(engine, prompts, prefix="r"):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{prefix}{i}", prompt, params)
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step(finished_only=True):
            final[out.request_id] = out.outputs[0].token_ids
    return [final[f"{prefix}{i}"] for i in range(len(prompts))]


def greedy_streamed(engine, prompts, prefix="s"):
    """``greedy`` as a server steps: every delta of every step."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{prefix}{i}", prompt, params)
    tokens = {f"{prefix}{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.outputs[0].token_ids
    return [tokens[f"{prefix}{i}"] for i in range(len(prompts))]


def transformers_greedy(checkpoint, prompts, max_new_tokens: int = MAX_TOKENS) -> list[list[int]]:
    """The single-device greedy reference, from transformers fp32 (stops after EOS id 2, included): the
    single-device engine equals it (tests/test_engine.py, test_sharding.py), and it costs no engine build."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    with torch.no_grad():
        return [model.generate(torch.tensor([p]), max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
                               eos_token_id=2, pad_token_id=2)[0, len(p):].tolist() for p in prompts]


def qwen3_checkpoint_in(directory, seed: int = 0) -> str:
    """A random Qwen3 checkpoint: 8 q / 2 kv heads (tp = 2 splits both), 3 layers (uneven pipeline stages)."""
    return str(save_random_hf_checkpoint(tiny_config("qwen3", num_attention_heads=8, num_key_value_heads=2,
                                                     num_hidden_layers=3), directory / "ckpt", seed=seed))


@pytest.fixture(scope="module")
def qwen3_checkpoint(tmp_path_factory):
    return qwen3_checkpoint_in(tmp_path_factory.mktemp("qwen3"))


@pytest.fixture(scope="module")
def qwen3_reference(qwen3_checkpoint):
    return transformers_greedy(qwen3_checkpoint, QWEN3_PROMPTS)


def test_single_device_engine_equals_the_reference_on_random_qwen3(qwen3_checkpoint, qwen3_reference):
    """What makes transformers the single-device engine's stand-in in these tests (one cheap engine build)."""
    engine = LLMEngine(EngineArgs(model=qwen3_checkpoint, **SMALL), use_tqdm=False)
    assert greedy(engine, QWEN3_PROMPTS) == qwen3_reference


@pytest.fixture(scope="module")
def qwen3_dp2(qwen3_checkpoint):
    return LLMEngine(EngineArgs(model=qwen3_checkpoint, data_parallel_size=2, **SMALL), use_tqdm=False)


def _assert_replicas_apart(engine: LLMEngine, group: int):
    """Each replica's KV pool lives on its own devices only; nothing compiled after warm-up."""
    seen = set()
    for index, replica in enumerate(engine.engine_core.cores):
        devices = set(replica.runner.kv_pool[0][0].sharding.device_set)
        assert len(devices) == group and not devices & seen, f"replica {index} on {devices}"
        seen |= devices
        assert replica.runner.num_compiles_since_warmup == 0


def test_dp2_greedy_matches_single_device_on_random_qwen3(qwen3_dp2, qwen3_reference):
    assert isinstance(qwen3_dp2.engine_core, DataParallelCore) and len(qwen3_dp2.engine_core.cores) == 2
    assert greedy(qwen3_dp2, QWEN3_PROMPTS) == qwen3_reference
    assert greedy_streamed(qwen3_dp2, QWEN3_PROMPTS) == qwen3_reference  # both replicas' outputs merged
    # Three requests over two idle replicas: the least loaded one took each, so both ran some.
    assert all(replica.num_steps > 0 for replica in qwen3_dp2.engine_core.cores)
    _assert_replicas_apart(qwen3_dp2, 1)


def test_dp2_by_tp2_greedy_matches_single_device_on_random_qwen3(qwen3_checkpoint, qwen3_reference, tmp_path):
    """Also after weight updates (paged_jax.worker.weight_update): every tp replica takes a trainer's state from a
    device of neither replica, then a checkpoint on disk, into its own shards, without compiling."""
    import jax
    from flax import nnx

    from models.loader import load_model

    engine = LLMEngine(EngineArgs(model=qwen3_checkpoint, data_parallel_size=2, tensor_parallel_size=2,
                                      **SMALL), use_tqdm=False)
    assert greedy(engine, QWEN3_PROMPTS) == qwen3_reference
    _assert_replicas_apart(engine, 2)
    other = qwen3_checkpoint_in(tmp_path, seed=1)
    state = jax.device_put(nnx.state(load_model(other, dtype="float32")[0]), jax.devices()[7])
    engine.update_weights(state)
    assert greedy(engine, QWEN3_PROMPTS, prefix="u") == transformers_greedy(other, QWEN3_PROMPTS) != qwen3_reference
    engine.update_weights_from_disk(qwen3_checkpoint)
    assert greedy(engine, QWEN3_PROMPTS, prefix="d") == qwen3_reference
    _assert_replicas_apart(engine, 2)


@pytest.mark.slow  # `make test-all`; CI: dp2 x tp2 on random Qwen3 above, pp2 x tp2 on SmolLM2 (test_pipeline_parallel)
def test_dp2_by_tp2_greedy_matches_single_device_on_smollm2(hf_greedy):
    engine = LLMEngine(EngineArgs(model=None, data_parallel_size=2, tensor_parallel_size=2, **SMALL),
                           use_tqdm=False)
    reference = [hf_greedy(p, MAX_TOKENS) for p in SMOLLM2_PROMPTS]
    assert greedy(engine, SMOLLM2_PROMPTS) == reference
    _assert_replicas_apart(engine, 2)


def test_repeated_prefix_goes_to_the_replica_that_caches_it(qwen3_dp2):
    engine = qwen3_dp2
    prefix = list(range(100, 124))  # three full blocks of 8
    long_params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    engine.add_request("busy", [7] * 9, long_params)  # idle replicas: replica 0 takes it
    engine.add_request("first", prefix + [1], SamplingParams(temperature=0.0, max_tokens=2))
    first_replica = engine.engine_core.replica_of("first")
    assert (engine.engine_core.replica_of("busy"), first_replica) == (0, 1)  # least loaded
    while engine.engine_core.replica_of("first") is not None:
        engine.step()
    # Make the replica holding the prefix the busier one; the prefix still wins over the load.
    cores = engine.engine_core.cores
    for name in ("filler", "filler2"):
        cores[first_replica].add_request(engine.input_processor.process(name, [9] * 9, long_params)[0])
    assert cores[first_replica].get_num_unfinished_requests() > cores[0].get_num_unfinished_requests()
    engine.add_request("again", prefix + [2, 3], SamplingParams(temperature=0.0, max_tokens=2))
    assert engine.engine_core.replica_of("again") == first_replica
    engine.add_request("other", [50 + i for i in range(20)], SamplingParams(temperature=0.0, max_tokens=2))
    assert engine.engine_core.replica_of("other") == 0  # no cached prefix anywhere: the less loaded one
    # Per-replica and total stats; the prefix hit shows on the replica that served "again".
    stats = engine.stats()
    assert len(stats["replicas"]) == 2
    assert stats["num_running"] + stats["num_waiting"] == sum(
        r["num_running"] + r["num_waiting"] for r in stats["replicas"])
    engine.abort_request(["busy", "filler", "again", "other"])
    cores[first_replica].abort_requests(["filler", "filler2"])
    assert not engine.has_unfinished_requests()
    hits_before = engine.stats()["replicas"][first_replica]["prefix_cache_hits"]
    greedy(engine, [prefix + [4]], prefix="hit")
    assert engine.stats()["replicas"][first_replica]["prefix_cache_hits"] >= hits_before + 24
    assert all(replica.runner.num_compiles_since_warmup == 0 for replica in cores)


def test_duplicate_request_id_and_lone_replica_refused(qwen3_dp2):
    qwen3_dp2.add_request("dup", [5, 6, 7], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="request_id"):
        qwen3_dp2.add_request("dup", [5, 6, 7], SamplingParams(max_tokens=1))
    qwen3_dp2.abort_request("dup")
    with pytest.raises(ValueError, match="data_parallel_size"):
        EngineCore(EngineArgs(data_parallel_size=2))
    with pytest.raises(ValueError, match="data_parallel_size"):
        LLMEngine(EngineArgs(data_parallel_size=3, tensor_parallel_size=4))  # 12 devices of 8


def test_metrics_label_each_replica(qwen3_dp2):
    from serving.metrics import ServingMetrics

    metrics = ServingMetrics("m", max_model_len=256)
    metrics.update_engine_stats(qwen3_dp2.stats())
    text = metrics.render().decode()
    assert 'paged_jax:num_requests_running{engine="0",model_name="m"}' in text
    assert 'paged_jax:generation_tokens_total{engine="1",model_name="m"}' in text
