"""models.weight_cache: a converted checkpoint is saved once and restored bit-identically (into the target shardings)
without reading safetensors; a changed checkpoint misses; half-written, racing or damaged entries are never served;
the engine caches only real checkpoints and only when asked, and a restarted engine generates the same tokens."""

import json
import logging
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from models import loader, weight_cache
from models.config import ModelConfig
from models.llama import LlamaForCausalLM, fuse_projections
from models.testing import save_random_hf_checkpoint, tiny_config

pytest.importorskip("torch")


@pytest.fixture
def llama_dir(tmp_path):
    return save_random_hf_checkpoint(tiny_config("llama"), tmp_path / "ckpt")


@pytest.fixture
def no_safetensors(monkeypatch):
    """Calling it makes every safetensors read in models.loader raise."""
    def forbid():
        def refuse(*args, **kwargs):
            raise AssertionError("safetensors was read on a cache hit")

        monkeypatch.setattr(loader, "safe_open", refuse)
        monkeypatch.setattr(loader, "_read_tensor", refuse)
        monkeypatch.setattr(loader, "_read_raw", refuse)
    return forbid


def fused_load(path, cache_dir, *, cache=True):
    """The single-device engine's load: fused fp32 model, through the cache."""
    config = ModelConfig.from_pretrained(path)
    key = weight_cache.cache_key(path, dtype="float32", layout={"kind": "fused"}) if cache else None
    return weight_cache.load_or_convert(
        key, lambda: fuse_projections(loader.load_model(path, dtype="float32", config=config)[0]),
        lambda: nnx.eval_shape(lambda: fuse_projections(
            LlamaForCausalLM(config, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0)))),
        cache_dir=cache_dir)


def flat_params(model):
    return {path: variable.get_value() for path, variable in nnx.to_flat_state(nnx.state(model))}


def assert_identical(a, b):
    assert nnx.graphdef(a) == nnx.graphdef(b)
    flat_a, flat_b = flat_params(a), flat_params(b)
    assert flat_a.keys() == flat_b.keys()
    for path in flat_a:
        assert flat_a[path].dtype == flat_b[path].dtype, path
        np.testing.assert_array_equal(np.asarray(flat_a[path]), np.asarray(flat_b[path]), err_msg=str(path))


def entries(cache_dir):
    return sorted(p.name for p in cache_dir.iterdir()) if cache_dir.is_dir() else []


def test_second_load_restores_bit_identical_params_without_safetensors(llama_dir, tmp_path, no_safetensors, caplog):
    cache_dir = tmp_path / "weights"
    with caplog.at_level(logging.INFO, logger="models.weight_cache"):
        first = fused_load(llama_dir, cache_dir)
    assert "converted" in caplog.text and "cached to" in caplog.text
    (entry,) = entries(cache_dir)
    assert entry.startswith("ckpt-")
    stored_key = json.loads((cache_dir / entry / weight_cache.KEY_FILE).read_text())
    assert stored_key["checkpoint"]["path"] == str(llama_dir.resolve())
    assert set(stored_key["checkpoint"]["files"]) == {"config.json", "model.safetensors"}
    assert stored_key["dtype"] == "float32" and stored_key["layout"] == {"kind": "fused"}

    no_safetensors()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="models.weight_cache"):
        second = fused_load(llama_dir, cache_dir)
    assert f"weights cache hit: restored from {cache_dir / entry}" in caplog.text
    assert_identical(first, second)
    device = jax.devices()[0]
    assert all(leaf.sharding.device_set == {device} for leaf in flat_params(second).values())


def test_key_depends_on_files_dtype_and_layout(llama_dir):
    key = weight_cache.cache_key(llama_dir, dtype="float32", layout={"kind": "fused"})
    assert weight_cache.cache_key(llama_dir, dtype="fp32", layout={"kind": "fused"}) == key
    assert weight_cache.cache_key(llama_dir, dtype="bfloat16", layout={"kind": "fused"}) != key
    assert weight_cache.cache_key(llama_dir, dtype="float32", layout={"kind": "other"}) != key
    (llama_dir / "tokenizer.json").write_text("{}")  # not read by the conversion
    assert weight_cache.cache_key(llama_dir, dtype="float32", layout={"kind": "fused"}) == key
    stat = (llama_dir / "model.safetensors").stat()
    os.utime(llama_dir / "model.safetensors", ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    assert weight_cache.cache_key(llama_dir, dtype="float32", layout={"kind": "fused"}) != key


def test_changed_checkpoint_is_converted_again_and_the_stale_entry_pruned(llama_dir, tmp_path):
    cache_dir = tmp_path / "weights"
    fused_load(llama_dir, cache_dir)
    (stale,) = entries(cache_dir)
    time.sleep(0.05)  # a distinct mtime even on a coarse file-system clock
    tensors = load_file(str(llama_dir / "model.safetensors"))
    tensors["model.norm.weight"] = tensors["model.norm.weight"] + 1.0
    save_file(tensors, str(llama_dir / "model.safetensors"))

    reloaded = fused_load(llama_dir, cache_dir)
    np.testing.assert_array_equal(np.asarray(reloaded.model.norm.scale[...]), tensors["model.norm.weight"])
    (fresh,) = entries(cache_dir)  # the stale entry can never hit again: pruned
    assert fresh != stale
    assert_identical(reloaded, fused_load(llama_dir, cache_dir))


def test_no_key_writes_nothing(llama_dir, tmp_path):
    cache_dir = tmp_path / "weights"
    fused_load(llama_dir, cache_dir, cache=False)
    assert not cache_dir.exists()


def test_half_written_entry_is_never_restored_and_old_ones_are_pruned(llama_dir, tmp_path, caplog):
    """A crash leaves only a hidden staging directory; the entry's name appears only through the final rename."""
    cache_dir = tmp_path / "weights"
    key = weight_cache.cache_key(llama_dir, dtype="float32", layout={"kind": "fused"})
    entry = weight_cache.entry_dir(key, cache_dir)
    crashed = cache_dir / f".{entry.name}.staging-crashed"
    (crashed / weight_cache.STATE_DIR).mkdir(parents=True)
    (crashed / weight_cache.KEY_FILE).write_text(json.dumps(key))
    with caplog.at_level(logging.INFO, logger="models.weight_cache"):
        fused_load(llama_dir, cache_dir)
    assert "cache hit" not in caplog.text
    assert entries(cache_dir) == [crashed.name, entry.name]  # too young to be garbage: it may be another writer's
    day_ago = time.time() - 2 * 24 * 3600
    os.utime(crashed, (day_ago, day_ago))
    assert weight_cache.prune(cache_dir) == [crashed]
    assert entries(cache_dir) == [entry.name]


def test_racing_writers_keep_one_entry(llama_dir, tmp_path):
    """Two processes converting at once: each writes its own staging directory; the first rename wins."""
    cache_dir = tmp_path / "weights"
    model = fused_load(llama_dir, cache_dir, cache=False)
    key = weight_cache.cache_key(llama_dir, dtype="float32", layout={"kind": "fused"})
    entry = weight_cache.entry_dir(key, cache_dir)
    weight_cache._save(entry, key, model)
    first_commit = (entry / weight_cache.KEY_FILE).stat().st_ino
    weight_cache._save(entry, key, model)  # loses the race: its copy is discarded, the committed one kept
    assert entries(cache_dir) == [entry.name]
    assert (entry / weight_cache.KEY_FILE).stat().st_ino == first_commit


def test_damaged_entry_is_converted_and_cached_again(llama_dir, tmp_path, caplog):
    cache_dir = tmp_path / "weights"
    first = fused_load(llama_dir, cache_dir)
    (entry,) = entries(cache_dir)
    state_dir = cache_dir / entry / weight_cache.STATE_DIR
    for path in state_dir.rglob("*"):
        if path.is_file() and "manifest" in path.name:
            path.unlink()
    with caplog.at_level(logging.INFO, logger="models.weight_cache"):
        second = fused_load(llama_dir, cache_dir)
    assert "cannot be restored" in caplog.text and "cached to" in caplog.text
    assert_identical(first, second)
    assert entries(cache_dir) == [entry]
    assert_identical(first, fused_load(llama_dir, cache_dir))


def test_sharded_restore_lands_in_the_target_shardings(tmp_path, no_safetensors):
    from models.tensor_parallel import abstract_model, load_sharded_model
    from paged_jax.parallel import ShardingPlan, make_mesh

    tp = 4
    if len(jax.devices()) < tp:
        pytest.skip(f"needs {tp} devices (conftest sets 8 fake CPU devices)")
    # 4 q heads / 2 kv heads on tp 4: kv heads replicated, so the stored layout is the head-rewritten one.
    path = save_random_hf_checkpoint(tiny_config("qwen2"), tmp_path / "qwen2")
    plan = ShardingPlan.create(ModelConfig.from_pretrained(path), make_mesh(tp))
    assert not plan.head_layout.is_identity
    key = weight_cache.cache_key(path, dtype="float32", layout={"kind": "tensor_parallel", "tp": tp})

    def load():
        return weight_cache.load_or_convert(
            key, lambda: load_sharded_model(path, plan, dtype="float32"),
            lambda: abstract_model(plan, jnp.float32), shardings=plan.state_shardings, cache_dir=tmp_path / "w")

    first = load()
    no_safetensors()
    second = load()
    assert_identical(first, second)
    targets = {p: v.get_value() for p, v in nnx.to_flat_state(plan.state_shardings(nnx.state(second)))}
    split = 0
    for path_, leaf in flat_params(second).items():
        assert leaf.sharding == targets[path_], path_
        split += len(leaf.sharding.device_set) == tp and not leaf.sharding.is_fully_replicated
    assert split > 0


# --------------------------------------------------------------------------------------------------------------------
# Engine
# --------------------------------------------------------------------------------------------------------------------

def _engine(model, **overrides):
    from paged_jax.config import EngineArgs
    from paged_jax.engine.llm_engine import LLMEngine

    settings = dict(model=str(model), dtype="float32", max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16,
                    num_gpu_blocks_override=16)
    settings.update(overrides)
    return LLMEngine(EngineArgs(**settings), use_tqdm=False)


def _greedy(engine, prompts, max_tokens=8):
    from paged_jax.sampling_params import SamplingParams

    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    done = {}
    while engine.has_unfinished_requests():
        for output in engine.step(finished_only=True):
            done[output.request_id] = output.outputs[0].token_ids
    return [done[str(i)] for i in range(len(prompts))]


@pytest.mark.parametrize("overrides", [dict(weight_cache=False), dict(load_format="dummy")],
                         ids=["weight_cache=False", "dummy"])
def test_engine_caches_nothing_when_off_or_dummy(llama_dir, tmp_path, monkeypatch, overrides):
    monkeypatch.setenv("PAGED_JAX_CACHE", str(tmp_path / "cache"))
    _engine(llama_dir, **overrides)
    assert not (tmp_path / "cache" / "weights").exists()


def test_smollm2_engine_restarted_from_the_cache_generates_the_same_tokens(smollm2_dir, tmp_path, monkeypatch,
                                                                          no_safetensors, caplog):
    monkeypatch.setenv("PAGED_JAX_CACHE", str(tmp_path / "cache"))
    prompts = [[1, 504, 3458, 282, 4649, 314], [1, 9690, 28, 940]]
    with caplog.at_level(logging.INFO, logger="models.weight_cache"):
        cold = _engine(smollm2_dir)
    assert "cached to" in caplog.text
    cold_tokens = _greedy(cold, prompts)
    del cold
    no_safetensors()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="models.weight_cache"):
        warm = _engine(smollm2_dir)
    assert "weights cache hit" in caplog.text
    assert _greedy(warm, prompts) == cold_tokens
    assert warm.startup_timings["model_load_s"] > 0


def test_benchmark_random_checkpoint_loads(tmp_path):
    """benchmarks.startup's numpy writer (the GPU start-up benchmark's checkpoint): sharded, bf16, loadable."""
    from benchmarks.startup import write_random_checkpoint

    path = write_random_checkpoint(tiny_config("qwen3", tie_word_embeddings=True), tmp_path / "rand",
                                   max_shard_bytes=40_000)
    assert (path / "model.safetensors.index.json").is_file()
    assert len(list(path.glob("model-*.safetensors"))) > 1
    model, config = loader.load_model(path, dtype="bfloat16")
    assert config.qk_norm and model.lm_head is None
    np.testing.assert_array_equal(np.asarray(model.model.norm.scale[...], np.float32), 1.0)
    kernel = np.asarray(model.model.layers[1].mlp.down_proj.kernel[...], np.float32)
    assert 0.01 < kernel.std() < 0.03 and len(np.unique(kernel)) > 1000
    assert write_random_checkpoint(tiny_config("qwen3"), path) == path  # complete: reused as is
