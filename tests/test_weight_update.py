"""Weight updates of a running engine (paged_jax.worker.weight_update, LLM.update_weights*): the engine runs the new
weights with its transforms re-applied, compiles nothing, resets its prefix cache, and keeps the old weights on any
mismatch."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.llama import fuse_projections
from models.loader import load_model
from models.testing import save_random_hf_checkpoint, tiny_config
from paged_jax.entrypoints.llm import LLM
from paged_jax.research.scoring import score_tokens
from paged_jax.sampling_params import SamplingParams

PROMPT = [3, 17, 42, 99, 7, 11, 5, 60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70]  # > one 16-token block
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, logprobs=0)
ENGINE = dict(dtype="float32", max_model_len=64, max_num_seqs=2, max_num_batched_tokens=32,
              num_gpu_blocks_override=16, weight_cache=False, use_tqdm=False)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("weights")
    return (save_random_hf_checkpoint(tiny_config("llama"), root / "a", seed=0),
            save_random_hf_checkpoint(tiny_config("llama"), root / "b", seed=1))


@pytest.fixture(scope="module")
def llm(checkpoints):
    return LLM(model=str(checkpoints[0]), **ENGINE)


def _run(llm):
    out = llm.generate([{"prompt_token_ids": PROMPT}], GREEDY, use_tqdm=False)[0].outputs[0]
    return out.token_ids, [lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids)]


def _state(path):
    model, _ = load_model(path, dtype="float32")
    return nnx.state(model)


def _assert_runs(llm, state):
    """The engine's greedy tokens' logprobs are the model ``state``'s (score_tokens on the same sequence)."""
    tokens, logprobs = _run(llm)
    model, _ = load_model(llm.llm_engine.model_path, dtype="float32")
    nnx.update(model, state)
    sequence = jnp.asarray([PROMPT + tokens], jnp.int32)
    scored = score_tokens(model, sequence, jnp.asarray([sequence.shape[1]], jnp.int32))[0, len(PROMPT):]
    np.testing.assert_allclose(logprobs, np.asarray(scored), atol=1e-4)
    return tokens


def _runner_leaves(llm):
    return [np.asarray(x) for x in llm.llm_engine.engine_core.runner.param_leaves]


def test_update_weights_in_process_runs_the_new_weights_without_compiling(llm, checkpoints):
    """From the model's nnx.State and from its pure dict on another device: the runner holds exactly the fused
    leaves a fresh load of that checkpoint has; the old buffers are deleted; nothing compiles."""
    path_a, path_b = checkpoints
    tokens_a = _assert_runs(llm, _state(path_a))
    old_leaf = llm.llm_engine.engine_core.runner.param_leaves[0]
    state_b = jax.device_put(_state(path_b), jax.devices()[1])  # a trainer's device: moved device to device
    llm.update_weights(state_b)
    assert old_leaf.is_deleted()
    expected = [np.asarray(x) for x in jax.tree.leaves(nnx.state(fuse_projections(load_model(path_b, dtype="float32")[0])))]
    for got, want in zip(_runner_leaves(llm), expected, strict=True):
        np.testing.assert_array_equal(got, want)
    assert _assert_runs(llm, _state(path_b)) != tokens_a
    llm.update_weights(nnx.to_pure_dict(_state(path_a)))
    assert _run(llm)[0] == tokens_a
    assert llm.llm_engine.engine_core.runner.num_compiles_since_warmup == 0


def test_update_weights_resets_the_prefix_cache(llm, checkpoints):
    engine = llm.llm_engine
    _run(llm)
    hits = engine.stats()["prefix_cache_hits"]
    _run(llm)
    assert engine.stats()["prefix_cache_hits"] > hits  # the same prompt: its full block is cached
    llm.update_weights(_state(checkpoints[0]))
    hits = engine.stats()["prefix_cache_hits"]
    _run(llm)
    assert engine.stats()["prefix_cache_hits"] == hits


def test_update_weights_takes_hf_names_and_checkpoints_on_disk(llm, checkpoints, tmp_path):
    """HF-named host arrays ([out, in] weights); an HF safetensors directory; an orbax checkpoint of the pure dict."""
    import orbax.checkpoint as ocp
    from safetensors.numpy import load_file

    path_a, path_b = checkpoints
    llm.update_weights(load_file(str(path_b / "model.safetensors")))
    tokens_b = _assert_runs(llm, _state(path_b))
    llm.update_weights_from_disk(str(path_a))
    tokens_a = _assert_runs(llm, _state(path_a))
    assert tokens_a != tokens_b
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "orbax", nnx.to_pure_dict(_state(path_b)))
    llm.update_weights_from_disk(str(tmp_path / "orbax"))
    assert _run(llm)[0] == tokens_b
    with pytest.raises(ValueError, match="neither"):
        llm.update_weights_from_disk(str(tmp_path))
    llm.update_weights_from_disk(str(path_a))
    assert llm.llm_engine.engine_core.runner.num_compiles_since_warmup == 0


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.pop("model.norm.scale"), "missing parameter 'model.norm.scale'"),
    (lambda d: d.update({"model.extra.kernel": d["model.norm.scale"]}), "unexpected parameter 'model.extra.kernel'"),
    (lambda d: d.update({"lm_head.kernel": d["lm_head.kernel"][:, :10]}), "'lm_head.kernel' has shape"),
    (lambda d: d.update({"model.norm.scale": d["model.norm.scale"].astype(jnp.bfloat16)}),
     "'model.norm.scale' has dtype bfloat16"),
])
def test_a_mismatch_names_the_parameter_and_keeps_the_old_weights(llm, checkpoints, edit, message):
    from paged_jax.worker.weight_update import flatten_named

    path_a, path_b = checkpoints
    tokens_a = _run(llm)[0]
    named = flatten_named(_state(path_b))
    edit(named)
    with pytest.raises(ValueError, match=message):
        llm.update_weights(named)
    assert _run(llm)[0] == tokens_a


def test_update_weights_requantizes_online(checkpoints):
    """int8 at load: the update quantizes and fuses the new weights exactly as loading that checkpoint does."""
    from models.quantization.config import resolve_quantization
    from models.quantization.load import load_quantized_model

    path_a, path_b = checkpoints
    llm = LLM(model=str(path_a), quantization="int8", **ENGINE)
    llm.update_weights(_state(path_b))
    config = llm.llm_engine.engine_core.model_config
    reference = fuse_projections(load_quantized_model(path_b, config, resolve_quantization("int8", {}),
                                                      dtype="float32"))
    for got, want in zip(_runner_leaves(llm), jax.tree.leaves(nnx.state(reference)), strict=True):
        np.testing.assert_array_equal(got, np.asarray(want))
    _run(llm)
    assert llm.llm_engine.engine_core.runner.num_compiles_since_warmup == 0


def test_processed_logprobs_equal_score_tokens_under_the_same_transform(checkpoints):
    """logprobs_mode="processed_logprobs": the sampled tokens' logprobs are those of the distribution sampled from
    (temperature, top-k, top-p, renormalized), as score_tokens computes it, in float32."""
    path_a, _ = checkpoints
    llm = LLM(model=str(path_a), logprobs_mode="processed_logprobs", **ENGINE)
    params = SamplingParams(temperature=0.7, top_k=20, top_p=0.9, seed=7, max_tokens=8, logprobs=0)
    out = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0].outputs[0]
    reported = [lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids)]
    model, _ = load_model(path_a, dtype="float32")
    sequence = jnp.asarray([PROMPT + list(out.token_ids)], jnp.int32)
    lengths = jnp.asarray([sequence.shape[1]], jnp.int32)
    processed = score_tokens(model, sequence, lengths, temperature=0.7, top_k=20, top_p=0.9)[0, len(PROMPT):]
    np.testing.assert_allclose(reported, np.asarray(processed), atol=1e-5)
    raw = score_tokens(model, sequence, lengths)[0, len(PROMPT):]
    assert not np.allclose(reported, np.asarray(raw), atol=1e-3)


@pytest.mark.parametrize("logprobs_mode", ["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"])
def test_sampler_logprobs_modes(logprobs_mode):
    """Each mode reports its values at the sampled token and its top-k: raw / processed (temperature, top-k, top-p;
    greedy rows undivided), as logits or log_softmax of them; filtered tokens are -inf."""
    from paged_jax.worker.logit_processing import temperature_and_filters
    from paged_jax.worker.sampler import sample, temperature_top_k_top_p_tensors

    logits = jax.random.normal(jax.random.key(0), (3, 64), jnp.float32) * 3
    temperature = jnp.asarray([0.0, 0.7, 1.3], jnp.float32)
    top_k, top_p = jnp.asarray([0, 5, 0], jnp.int32), jnp.asarray([1.0, 1.0, 0.8], jnp.float32)
    tensors = temperature_top_k_top_p_tensors(temperature, top_k, top_p, jnp.arange(3, dtype=jnp.uint32),
                                              jnp.zeros(3, jnp.int32))
    out = sample(logits, tensors, mode="top_k", num_logprobs=4, logprobs_mode=logprobs_mode)
    values = logits
    if logprobs_mode.startswith("processed"):
        safe = jnp.where(temperature > 0, temperature, 1.0)
        filtered = temperature_and_filters(logits, safe, jnp.zeros(3), top_k, top_p)
        values = jnp.where((temperature > 0)[:, None], filtered, logits)
    if logprobs_mode.endswith("logprobs"):
        values = jax.nn.log_softmax(values, axis=-1)
    rows = jnp.arange(3)
    np.testing.assert_allclose(out.logprobs, values[rows, out.token_ids], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out.top_logprobs, -jnp.sort(-values, axis=-1)[:, :4], rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------- tensor parallelism
@pytest.fixture(scope="module")
def tp_llm(checkpoints):
    return LLM(model=str(checkpoints[0]), tensor_parallel_size=2, **ENGINE)


def _tensor_parallel_leaves(path, **engine_args):
    """The parameter leaves the engine's tensor-parallel loader builds from ``path`` (no engine), its plan and
    quantization."""
    from models.config import ModelConfig
    from paged_jax.config import EngineArgs
    from paged_jax.worker.model_loader import _load_tensor_parallel, resolve_engine_quantization

    args = EngineArgs(model=str(path), dtype="float32", weight_cache=False, **engine_args)
    quant = resolve_engine_quantization(args, str(path))
    model, plan, *_ = _load_tensor_parallel(args, str(path), ModelConfig.from_pretrained(path), "float32", quant)
    return jax.tree.leaves(nnx.state(model)), plan, quant.config


@contextlib.contextmanager
def _written_in_place(runner):
    """The update's programs write the new weights into the donated buffers of the old ones: no second copy (of
    buffers XLA allocated: one that wraps host memory, as a CPU ``device_put`` of a numpy array may, is copied)."""
    def buffers():
        return sorted((shard.device.id, shard.data.unsafe_buffer_pointer()) for leaf in runner.param_leaves
                      for shard in leaf.addressable_shards)

    before = buffers()
    yield
    assert buffers() == before


def _assert_same_leaves(got, want):
    for index, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.sharding == w.sharding, index
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_tensor_parallel_update_lands_in_the_engines_shards(tp_llm, llm, checkpoints, tmp_path):
    """tp = 2: a trainer's state on a device outside the engine's mesh, HF-named host arrays, a safetensors and an
    orbax checkpoint on disk each give exactly the tensor-parallel loader's leaves (values and shardings) and the
    one-device engine's greedy tokens; a mismatch names the parameter and the old weights keep serving; nothing
    compiles."""
    import orbax.checkpoint as ocp
    from safetensors.numpy import load_file

    from paged_jax.worker.weight_update import flatten_named

    path_a, path_b = checkpoints
    runner = tp_llm.llm_engine.engine_core.runner
    tokens_a = _assert_runs(tp_llm, _state(path_a))
    assert tokens_a == _run(llm)[0]
    old_leaf = runner.param_leaves[0]
    trainer_device = jax.devices()[5]
    assert trainer_device not in runner.sharding_plan.mesh.devices.flat
    tp_llm.update_weights(jax.device_put(_state(path_b), trainer_device))
    assert old_leaf.is_deleted()
    _assert_same_leaves(runner.param_leaves, _tensor_parallel_leaves(path_b, tensor_parallel_size=2)[0])
    tokens_b = _assert_runs(tp_llm, _state(path_b))
    llm.update_weights_from_disk(str(path_b))
    assert tokens_b == _run(llm)[0] != tokens_a
    llm.update_weights_from_disk(str(path_a))

    with _written_in_place(runner):
        tp_llm.update_weights(load_file(str(path_a / "model.safetensors")))  # HF names, [out, in], on the host
    assert _run(tp_llm)[0] == tokens_a
    tp_llm.update_weights_from_disk(str(path_b))
    assert _run(tp_llm)[0] == tokens_b
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "orbax", nnx.to_pure_dict(_state(path_a)))
    tp_llm.update_weights_from_disk(str(tmp_path / "orbax"))
    _assert_same_leaves(runner.param_leaves, _tensor_parallel_leaves(path_a, tensor_parallel_size=2)[0])

    tp_llm.update_weights(jax.tree.unflatten(runner._state_treedef, runner.param_leaves))  # its own arrays back
    _assert_same_leaves(runner.param_leaves, _tensor_parallel_leaves(path_a, tensor_parallel_size=2)[0])
    # A trainer's arrays already in the engine's shardings: the engine keeps copies, the trainer may delete them.
    given = _tensor_parallel_leaves(path_b, tensor_parallel_size=2)[0]
    tp_llm.update_weights(jax.tree.unflatten(runner._state_treedef, given))
    for leaf in given:
        leaf.delete()
    assert _run(tp_llm)[0] == tokens_b
    tp_llm.update_weights_from_disk(str(path_a))
    named = flatten_named(_state(path_b))
    named["model.layers.1.self_attn.k_proj.kernel"] = named["model.layers.1.self_attn.k_proj.kernel"][:, :8]
    with pytest.raises(ValueError, match="'model.layers.1.self_attn.k_proj.kernel' has shape"):
        tp_llm.update_weights(named)
    assert _run(tp_llm)[0] == tokens_a
    assert runner.num_compiles_since_warmup == 0


@pytest.fixture(scope="module")
def moe_checkpoints(tmp_path_factory):
    from models.quantization.testing import save_block_fp8_checkpoint

    root = tmp_path_factory.mktemp("moe_weights")
    checkpoints = {arch: (save_random_hf_checkpoint(tiny_config(arch), root / arch / "a", seed=0),
                          save_random_hf_checkpoint(tiny_config(arch), root / arch / "b", seed=1))
                   for arch in ("mixtral", "qwen3_moe")}
    checkpoints["qwen3_moe_block_fp8"] = tuple(  # float8 experts and their block scales, split whole
        save_block_fp8_checkpoint(path, path.parent / f"{path.name}_fp8", path.parent / f"{path.name}_dequantized",
                                  block=(16, 32)) for path in checkpoints["qwen3_moe"])
    return checkpoints


@pytest.mark.parametrize("arch, layout", [
    ("llama", dict(tensor_parallel_size=4)),  # 2 kv heads over 4 devices: the head rewrite
    ("llama", dict(tensor_parallel_size=2, quantization="int8")),
    ("llama", dict(tensor_parallel_size=2, quantization="fp8")),
    ("mixtral", dict(tensor_parallel_size=2)),  # experts split over their width
    ("qwen3_moe", dict(tensor_parallel_size=2, enable_expert_parallel=True)),  # whole experts per device
    ("qwen3_moe_block_fp8", dict(tensor_parallel_size=2, enable_expert_parallel=True)),
], ids=["tp4-head-rewrite", "tp2-int8", "tp2-fp8", "mixtral-tp2", "qwen3_moe-tp2-ep", "qwen3_moe-block-fp8-tp2-ep"])
def test_tensor_parallel_update_rebuilds_the_loaders_leaves(checkpoints, moe_checkpoints, arch, layout):
    """The update of a tensor-parallel runner's leaves (the loader's, no engine) equals loading the new checkpoint
    with the same layout, value for value and sharding for sharding: heads rewritten, online quantization, experts
    split over their width or whole (float8 ones with their block scales); each split input reaches the devices as
    their slices only."""
    from types import SimpleNamespace

    from models.config import ModelConfig
    from paged_jax.worker.weight_update import WeightUpdater, read_checkpoint

    path_a, path_b = checkpoints if arch == "llama" else moe_checkpoints[arch]
    leaves, plan, quant = _tensor_parallel_leaves(path_a, **layout)
    assert plan.head_layout.is_identity == (layout["tensor_parallel_size"] == 2)
    runner = SimpleNamespace(sharding_plan=plan, param_leaves=[jnp.copy(leaf) for leaf in leaves], dtype=jnp.float32,
                             input_sharding=lambda: plan.replicated)
    updater = WeightUpdater(runner, ModelConfig.from_pretrained(path_a), quant)
    named = read_checkpoint(path_b, updater)
    q_proj = named["model.layers.0.self_attn.q_proj.kernel"]
    assert q_proj.sharding.shard_shape(q_proj.shape)[1] == q_proj.shape[1] // layout["tensor_parallel_size"]
    with _written_in_place(runner):
        updater.update(named, cast=True)
    _assert_same_leaves(runner.param_leaves, _tensor_parallel_leaves(path_b, **layout)[0])


def test_pipeline_update_rebuilds_each_stages_leaves(tmp_path):
    """pp = 2 x tp = 4 (heads rewritten), tied embeddings: each stage's parameters land in that stage's shards as the
    pipeline's loader puts them, and the pipeline's forward is told to take them."""
    from types import SimpleNamespace

    from models.config import ModelConfig
    from models.tensor_parallel import load_sharded_model
    from paged_jax.parallel.pipeline import PipelinePlan
    from paged_jax.worker.weight_update import WeightUpdater

    paths = [save_random_hf_checkpoint(tiny_config("llama", tie_word_embeddings=True), tmp_path / name, seed=seed)
             for seed, name in enumerate("ab")]
    config = ModelConfig.from_pretrained(paths[0])
    plan = PipelinePlan.create(config, 2, 4)
    loaded = [jax.tree.leaves(nnx.state(load_sharded_model(path, plan, dtype="float32"))) for path in paths]
    replaced = []
    runner = SimpleNamespace(sharding_plan=plan, param_leaves=[jnp.copy(leaf) for leaf in loaded[0]],
                             dtype=jnp.float32,
                             input_sharding=lambda: plan.replicated,
                             forward_strategy=SimpleNamespace(param_leaves_replaced=replaced.append))
    updater = WeightUpdater(runner, config)
    with _written_in_place(runner):
        updater.update(jax.device_put(_state(paths[1]), jax.devices()[0]))
    assert replaced == [runner]
    assert {len(leaf.sharding.device_set) for leaf in runner.param_leaves} == {4}  # one stage's devices each
    _assert_same_leaves(runner.param_leaves, loaded[1])


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_an_eagle_drafter_follows_the_targets_new_weights(tp, request, checkpoints, tmp_path):
    """An EAGLE head shares the target's embedding and LM head (at tp = 2, their shards): after an update it drafts
    with the new ones (the runner's new arrays, the old buffers gone), and the engine's greedy tokens are the new
    weights' (the engine's without drafts at the same tp)."""
    import json

    from models.testing import save_random_eagle_head

    plain = request.getfixturevalue("llm" if tp == 1 else "tp_llm")
    path_a, path_b = checkpoints
    head = save_random_eagle_head(json.loads((path_a / "config.json").read_text()), tmp_path / "eagle",
                                  intermediate_size=64)
    spec = {"method": "eagle", "model": str(head), "num_speculative_tokens": 2}
    drafting = LLM(model=str(path_a), speculative_config=spec, tensor_parallel_size=tp, **ENGINE)
    plain.update_weights_from_disk(str(path_a))
    assert _run(drafting)[0] == _run(plain)[0]
    runner = drafting.llm_engine.engine_core.runner
    old = [runner.drafter._leaves[own] for own, _ in runner.drafter._target_leaves]
    drafting.update_weights_from_disk(str(path_b))
    plain.update_weights_from_disk(str(path_b))
    assert len(old) == 2 and all(leaf.is_deleted() for leaf in old)
    assert all(runner.drafter._leaves[own] is runner.param_leaves[target]
               for own, target in runner.drafter._target_leaves)
    assert _run(drafting)[0] == _run(plain)[0]
    plain.update_weights_from_disk(str(path_a))
    assert drafting.llm_engine.stats()["spec_decode_num_drafts"] > 0
    assert drafting.llm_engine.engine_core.runner.num_compiles_since_warmup == 0
