"""Expert parallelism (``--enable-expert-parallel``) and tensor parallelism inside the experts on CPU meshes of host
devices: the tiny Qwen3-MoE and Mixtral checkpoints at tp = 2 and 4, DeepSeek-V2 (latent attention: q heads split
over a replicated latent cache; shared experts) and Llama 4 (fused gate/up experts, shared expert, chunked and NoPE
layers) at tp = 4 through the model call and tp = 2 through the engine, EP on and off, gpt-oss (attention sinks split
with their q heads; float and MXFP4 experts split by width or whole) at tp = 2, 4 and 8, equal to one device (logits,
greedy fp32 tokens); what is refused is named."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from models.attention import dense_causal_attention
from models.loader import load_model
from models.moe import SparseMoeBlock, grouped_matmul_reference, moe_experts_reference
from models.moe_routing import local_experts_partial
from models.testing import save_random_hf_checkpoint, tiny_config

pytest.importorskip("transformers")

ARCHS = {"qwen3_moe": dict(num_hidden_layers=3, mlp_only_layers=[1]), "mixtral": dict(num_hidden_layers=2),
         "deepseek_v2": {}, "llama4": {}, "gpt_oss": {}}
SEQ_LENS = (7, 1, 12)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    paths = {}
    for arch, overrides in ARCHS.items():
        paths[arch] = tmp_path_factory.mktemp(arch)
        save_random_hf_checkpoint(tiny_config(arch, eos_token_id=None, **overrides), paths[arch], seed=13)
    return paths


def _forward_logits(model, config, seqs):
    input_ids = np.concatenate(seqs)
    positions = np.concatenate([np.arange(len(s), dtype=np.int32) for s in seqs])
    segment_ids = np.concatenate([np.full(len(s), i, dtype=np.int32) for i, s in enumerate(seqs)])

    @nnx.jit
    def forward(model, ids):
        attention = dense_causal_attention(segment_ids, config.head_dim ** -0.5, positions=positions)
        hidden, _ = model(ids, jnp.asarray(positions), None, attention)
        return model.compute_logits(hidden)

    return np.asarray(forward(model, input_ids))


def test_local_expert_shares_sum_to_the_whole_layer():
    """Splitting the experts into devices' shares and summing their float32 partials is the layer's output, with the
    reference grouped matmul and with the Pallas kernel (interpreted; it leaves the rows of other devices' experts,
    past every group, unwritten)."""
    import functools

    from paged_jax.ops.fused_moe import grouped_matmul_pallas

    rng = np.random.default_rng(0)
    num_experts, hidden, inter, tokens, top_k = 8, 16, 12, 9, 2
    x = jnp.asarray(rng.standard_normal((tokens, hidden)), jnp.float32)
    gate, up = (jnp.asarray(rng.standard_normal((num_experts, hidden, inter)), jnp.float32) for _ in range(2))
    down = jnp.asarray(rng.standard_normal((num_experts, inter, hidden)), jnp.float32)
    weights = jnp.asarray(rng.random((tokens, top_k)), jnp.float32)
    ids = jnp.asarray(np.stack([rng.choice(num_experts, top_k, replace=False) for _ in range(tokens)]), jnp.int32)
    whole = moe_experts_reference(x, gate, up, down, weights, ids)
    kernel = functools.partial(grouped_matmul_pallas, interpret=True)
    for grouped_matmul, ep in ((grouped_matmul_reference, 2), (grouped_matmul_reference, 4), (kernel, 4)):
        size = num_experts // ep
        shares = [local_experts_partial(grouped_matmul, x, gate[d * size:(d + 1) * size],
                                        up[d * size:(d + 1) * size], down[d * size:(d + 1) * size], weights, ids,
                                        jnp.int32(d * size)) for d in range(ep)]
        np.testing.assert_allclose(np.asarray(sum(shares)), np.asarray(whole), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch, tp", [(arch, tp) for arch in ("mixtral", "qwen3_moe") for tp in (2, 4)]
                         + [("deepseek_v2", 4), ("llama4", 4)])
def test_model_call_equals_one_device(checkpoints, arch, tp):
    """Logits of the model call with the experts split over their width (EP off) or over the experts (EP on) equal
    one device's; with EP each device holds num_experts / tp whole experts. Llama 4's fused gate/up experts split by
    width run per device (``ExpertParallel`` over their width); DeepSeek's q heads split, its latent projections
    (and cache) are whole on every device."""
    from models.tensor_parallel import load_sharded_model
    from paged_jax.parallel import ShardingPlan, make_mesh

    checkpoint = checkpoints[arch]
    model, config = load_model(checkpoint, dtype="float32")
    rng = np.random.default_rng(2)
    seqs = [rng.integers(3, config.vocab_size, size=n).astype(np.int32) for n in SEQ_LENS]
    reference = _forward_logits(model, config, seqs)
    num_experts = config.moe.num_experts
    for expert_parallel in (False, True):
        plan = ShardingPlan.create(config, make_mesh(tp), expert_parallel=expert_parallel)
        sharded = load_sharded_model(checkpoint, plan, dtype="float32")
        block = next(layer.mlp for layer in sharded.model.layers if isinstance(layer.mlp, SparseMoeBlock))
        down = block.experts.down_proj.get_value()
        if expert_parallel:
            assert down.sharding.spec == P("tp", None, None)
            assert down.sharding.shard_shape(down.shape)[0] == num_experts // tp
            assert block.expert_parallel.whole_experts and block.impl == "auto"  # the kernel on a GPU
        else:
            assert down.sharding.spec == P(None, "tp", None)
            assert (block.expert_parallel is None) == (arch != "llama4")
        if arch == "deepseek_v2":
            attn = sharded.model.layers[0].self_attn
            assert attn.q_b_proj.kernel.get_value().sharding.spec == P(None, "tp")
            assert attn.kv_a_proj_with_mqa.kernel.get_value().sharding.spec == P()
            assert block.shared_experts.down_proj.kernel.get_value().sharding.spec == P("tp", None)
            assert block.gate.kernel.get_value().sharding.spec == P()  # grouped top-k on every device alike
        np.testing.assert_allclose(_forward_logits(sharded, config, seqs), reference, atol=2e-5, rtol=0)


@pytest.mark.parametrize("arch, dp, tp", [("qwen3_moe", 2, 2), ("mixtral", 2, 4)])
def test_expert_parallel_spans_dp_by_tp(checkpoints, arch, dp, tp):
    """On a (dp, tp) mesh (data-parallel attention: each dp group its own sequences) EP spans dp x tp, as vLLM's EP
    size = TP x DP: each device holds num_experts / (dp * tp) whole experts, a sparse layer all-gathers its tokens
    over dp and reduce-scatters the float32 sums back, and each group's logits equal one device's. Without EP the
    experts split by width over tp and each dp group runs its own tokens."""
    from benchmarks.sharding import count_collectives
    from models.tensor_parallel import load_sharded_model
    from paged_jax.parallel import ShardingPlan, make_mesh
    from tests.test_sharding import _forward_fn

    checkpoint = checkpoints[arch]
    model, config = load_model(checkpoint, dtype="float32")
    rng = np.random.default_rng(5)
    seqs = [rng.integers(3, config.vocab_size, size=n).astype(np.int32) for n in SEQ_LENS]
    reference = _forward_logits(model, config, seqs)
    # dp group 0: the first two sequences and 4 padding tokens (segment -1); group 1: the third; positions and
    # segment ids are each group's own.
    tokens = np.concatenate([*seqs[:2], np.zeros(4, np.int32), seqs[2]])
    positions = np.concatenate([np.arange(7), [0], np.zeros(4), np.arange(12)]).astype(np.int32)
    segments = np.array([0] * 7 + [1] + [-1] * 4 + [0] * 12, np.int32)
    real = np.r_[0:8, 12:24]  # the rows of the 20 real tokens, in the reference's order
    for expert_parallel in (True, False):
        plan = ShardingPlan.create(config, make_mesh(tp, dp), expert_parallel=expert_parallel)
        sharded = load_sharded_model(checkpoint, plan, dtype="float32")
        block = _sparse_block(sharded)
        down = block.experts.down_proj.get_value()
        split = block.expert_parallel
        if expert_parallel:
            assert down.sharding.spec == P(("dp", "tp"), None, None)
            assert down.sharding.shard_shape(down.shape)[0] == config.moe.num_experts // (dp * tp)
            assert split.axes == ("dp", "tp") and split.token_axis == "dp" and split.size == dp * tp
            hlo = _forward_fn(plan).lower(sharded, tokens, positions, segments).compile().as_text()
            counts = count_collectives(hlo)  # the dispatch and the combine
            assert counts["all-gather"] >= 1 and counts["reduce-scatter"] >= 1, counts
        else:  # XLA partitions these experts' width (Llama 4's and gpt-oss's: test_sparse_block_on_dp_by_tp_...)
            assert down.sharding.shard_shape(down.shape)[0] == config.moe.num_experts and split is None
        logits = np.asarray(_forward_fn(plan)(sharded, tokens, positions, segments))
        np.testing.assert_allclose(logits[real], reference, atol=2e-5, rtol=0)


def _sparse_block(model):
    """The model's first sparse MoE block (Llama 4's ``feed_forward``, the others' ``mlp``)."""
    return next(mlp for mlp in (getattr(layer, "feed_forward", None) or layer.mlp for layer in model.model.layers)
                if hasattr(mlp, "experts"))


@pytest.mark.parametrize("arch", ["gpt_oss", "llama4", "qwen3_moe-fp8"])
def test_sparse_block_on_dp_by_tp_equals_one_device(checkpoints, arch, tmp_path):
    """One sparse block on a dp 2 x tp 2 mesh, its tokens split over dp, equal to one device's: gpt-oss (biases, the
    clamped SwiGLU) and Llama 4 (each token's row per expert) with EP (whole experts over dp x tp) and without (their
    width over tp, each dp group its own tokens), block-FP8 experts (EP only: their scales split whole too); with 8
    tokens and with 7, which dp does not divide (taken whole on every device)."""
    from jax.sharding import NamedSharding

    from models.quantization.testing import save_block_fp8_checkpoint
    from models.tensor_parallel import load_sharded_model
    from paged_jax.parallel import ShardingPlan, make_mesh

    checkpoint = checkpoints.get(arch)
    if arch == "qwen3_moe-fp8":
        checkpoint = save_block_fp8_checkpoint(checkpoints["qwen3_moe"], tmp_path / "fp8", tmp_path / "dequantized",
                                               block=(16, 32))
    model, config = load_model(checkpoint, dtype="float32")
    run = nnx.jit(lambda block, x: block(x))
    rng = np.random.default_rng(11)
    inputs = [jnp.asarray(rng.standard_normal((n, config.hidden_size)), jnp.float32) for n in (8, 7)]
    references = [np.asarray(run(_sparse_block(model), x)) for x in inputs]
    for expert_parallel in (True, False) if arch != "qwen3_moe-fp8" else (True,):
        plan = ShardingPlan.create(config, make_mesh(2, 2), expert_parallel=expert_parallel)
        block = _sparse_block(load_sharded_model(checkpoint, plan, dtype="float32"))
        assert block.expert_parallel.token_axis == "dp"
        assert block.expert_parallel.whole_experts == expert_parallel
        for x, reference in zip(inputs, references):
            spec = P("dp") if x.shape[0] % 2 == 0 else P()
            got = np.asarray(run(block, jax.device_put(x, NamedSharding(plan.mesh, spec))))
            np.testing.assert_allclose(got, reference, atol=1e-5, rtol=0)


_ONE_DEVICE: dict = {}  # the one-device tokens of each checkpoint, computed once


def _greedy(path, prompts, *, check_pool=None, **layout):
    """The engine's greedy tokens of ``prompts``; ``check_pool(plan, kv_pool)`` is called on its KV pool."""
    from paged_jax.entrypoints.llm import LLM
    from paged_jax.sampling_params import SamplingParams

    llm = LLM(model=str(path), dtype="float32", max_model_len=64, max_num_seqs=2, max_num_batched_tokens=32,
              num_gpu_blocks_override=64, use_tqdm=False, **layout)
    out = llm.generate([{"prompt_token_ids": p} for p in prompts],
                       SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    runner = llm.llm_engine.engine_core.runner
    assert runner.num_compiles_since_warmup == 0
    assert all(o.outputs[0].routed_experts is None for o in out)  # off by default
    if check_pool is not None:
        check_pool(runner.sharding_plan, runner.kv_pool)
    return [list(o.outputs[0].token_ids) for o in out]


def _one_device_picks(path, prompts, outputs):
    """Whether the one-device model, fed each prompt and its output, picks every output token greedily: the
    one-device greedy decode of the prompts is then ``outputs`` (one model call instead of an engine)."""
    model, config = load_model(path, dtype="float32")
    seqs = [np.asarray(p + out[:-1], np.int32) for p, out in zip(prompts, outputs)]
    picks = _forward_logits(model, config, seqs).argmax(-1)
    starts = np.cumsum([0] + [len(s) for s in seqs])
    return [picks[start + len(p) - 1:end].tolist() for start, end, p in zip(starts, starts[1:], prompts)] == outputs


def _latent_pool_whole_on_each_device(plan, kv_pool):
    """A latent cache: one KV head of [latent | rope key] rows, the same on every tp device; no V width."""
    k_pages, v_pages = kv_pool[0][:2]
    assert k_pages.shape[2:] == (1, plan.config.mla.latent_dim) and v_pages.shape[-1] == 0
    assert k_pages.sharding.is_fully_replicated and len(k_pages.sharding.device_set) == 2


# tp = 2 and 4, EP on and off, over the architectures (Mixtral at tp = 2 without EP: tests/test_moe.py). Qwen3-MoE
# at tp = 4 without EP, DeepSeek-V2 at tp = 2 without EP and Llama 4 at tp = 2 with EP run with make test-all
# (slow): tensor parallelism inside the experts is covered by Mixtral's tp = 2 case in tests/test_moe.py and Llama 4's
# here, latent attention by DeepSeek's EP case, whole experts by the other EP cases; the model-call test runs every
# layout of each.
@pytest.mark.parametrize("arch, layout", [
    ("qwen3_moe", dict(tensor_parallel_size=2, enable_expert_parallel=True)),
    pytest.param("qwen3_moe", dict(tensor_parallel_size=4, enable_expert_parallel=False), marks=pytest.mark.slow),
    ("mixtral", dict(tensor_parallel_size=4, enable_expert_parallel=True)),
], ids=["qwen3_moe-tp2-ep", "qwen3_moe-tp4", "mixtral-tp4-ep"])
def test_engine_greedy_equals_one_device(checkpoints, arch, layout):
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 256, size=n).tolist() for n in (5, 18)]
    if arch not in _ONE_DEVICE:
        _ONE_DEVICE[arch] = _greedy(checkpoints[arch], prompts)
    assert _greedy(checkpoints[arch], prompts, **layout) == _ONE_DEVICE[arch]


@pytest.mark.parametrize("arch, layout", [
    ("deepseek_v2", dict(tensor_parallel_size=2, enable_expert_parallel=True)),
    pytest.param("deepseek_v2", dict(tensor_parallel_size=2), marks=pytest.mark.slow),
    ("llama4", dict(tensor_parallel_size=2)),
    pytest.param("llama4", dict(tensor_parallel_size=2, enable_expert_parallel=True), marks=pytest.mark.slow),
], ids=["deepseek_v2-tp2-ep", "deepseek_v2-tp2", "llama4-tp2", "llama4-tp2-ep"])
def test_engine_greedy_equals_one_device_model(checkpoints, arch, layout):
    """DeepSeek-V2 (its latent cache whole on each device) and Llama 4 (prompts across its 12-token attention
    chunks): the engine's greedy tokens are the one-device model's picks."""
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 256, size=n).tolist() for n in (5, 18)]
    check_pool = _latent_pool_whole_on_each_device if arch == "deepseek_v2" else None
    outputs = _greedy(checkpoints[arch], prompts, check_pool=check_pool, **layout)
    assert _one_device_picks(checkpoints[arch], prompts, outputs)


def test_refusals_name_the_field(tmp_path):
    from models.config import ModelConfig
    from paged_jax.config import EngineArgs
    from paged_jax.entrypoints.llm import LLM
    from paged_jax.parallel import ShardingPlan, make_mesh
    from paged_jax.parallel.pipeline import PipelinePlan

    six_experts = ModelConfig.from_hf_config(tiny_config("qwen3_moe", num_experts=6))
    with pytest.raises(ValueError, match=r"enable_expert_parallel: num_experts \(6\) must be divisible.*\(4 "):
        ShardingPlan.create(six_experts, make_mesh(4), expert_parallel=True)
    deepseek = ModelConfig.from_hf_config(tiny_config("deepseek_v2"))
    with pytest.raises(ValueError, match=r"tensor_parallel_size=8 must divide num_attention_heads \(4\)"):
        ShardingPlan.create(deepseek, make_mesh(8))
    llama4 = ModelConfig.from_hf_config(tiny_config("llama4", intermediate_size=36))
    with pytest.raises(ValueError, match=r"tensor_parallel_size=8 must divide the experts' intermediate_size \(36\)"):
        ShardingPlan.create(llama4, make_mesh(8))
    ShardingPlan.create(llama4, make_mesh(4), expert_parallel=True)  # whole experts: any width
    gpt_oss = ModelConfig.from_hf_config(tiny_config("gpt_oss", quantization_config={"quant_method": "mxfp4"}))
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 must divide the experts' intermediate_size \(64\) "
                                         r"of GptOssForCausalLM in whole 32-wide MXFP4 scale blocks \(2\) \(or "
                                         "enable_expert_parallel"):
        ShardingPlan.create(gpt_oss, make_mesh(4))
    for config in (deepseek, llama4, gpt_oss):
        with pytest.raises(ValueError, match=f"^pipeline_parallel_size=2: {config.architecture}'s"):
            PipelinePlan.create(config, 2, 1)
    dense = ModelConfig.from_hf_config(tiny_config("qwen3"))
    with pytest.raises(ValueError, match="enable_expert_parallel: Qwen3ForCausalLM has no mixture-of-experts"):
        ShardingPlan.create(dense, make_mesh(2), expert_parallel=True)
    for other in ("data_parallel_size", "pipeline_parallel_size"):
        with pytest.raises(ValueError, match=f"^enable_expert_parallel is not supported with {other} > 1"):
            EngineArgs(enable_expert_parallel=True, **{other: 2})
    # Through the engine: a dense checkpoint is refused before anything is compiled.
    save_random_hf_checkpoint(tiny_config("qwen3"), tmp_path)
    with pytest.raises(ValueError, match="enable_expert_parallel: Qwen3ForCausalLM has no mixture-of-experts"):
        LLM(model=str(tmp_path), dtype="float32", tensor_parallel_size=2, enable_expert_parallel=True,
            use_tqdm=False)


def test_deepseek_v3_parameter_shardings():
    """Every parameter of DeepSeek-V3 (q bottleneck, router correction bias, shared experts) has a rule, shapes only:
    the latent projections and the router whole on each device, the q heads and the shared experts split."""
    from flax import nnx

    from models.config import ModelConfig
    from models.tensor_parallel import abstract_model
    from paged_jax.parallel import ShardingPlan, make_mesh

    plan = ShardingPlan.create(ModelConfig.from_hf_config(tiny_config("deepseek_v3")), make_mesh(2),
                               expert_parallel=True)
    specs = {".".join(map(str, path[3:])): leaf.get_value().spec
             for path, leaf in nnx.to_flat_state(plan.state_shardings(nnx.state(abstract_model(plan, jnp.float32))))
             if path[:3] == ("model", "layers", 1)}
    assert specs["mlp.gate.e_score_correction_bias"] == specs["mlp.gate.kernel"] == P()
    assert specs["self_attn.q_a_proj.kernel"] == specs["self_attn.kv_a_proj_with_mqa.kernel"] == P()
    assert specs["self_attn.q_b_proj.kernel"] == specs["self_attn.kv_b_proj.kernel"] == P(None, "tp")
    assert specs["self_attn.o_proj.kernel"] == specs["mlp.shared_experts.down_proj.kernel"] == P("tp", None)
    assert specs["mlp.experts.gate_proj"] == P("tp", None, None)


def test_block_fp8_experts_split_whole_over_devices(tmp_path):
    """A block-FP8 Qwen3-MoE checkpoint: with expert parallelism each device holds num_experts / tp whole float8
    experts and their scales, and the logits (and the engine's greedy tokens) equal one device's; splitting the
    experts' width is refused, naming enable_expert_parallel."""
    from models.quantization.testing import save_block_fp8_checkpoint
    from models.tensor_parallel import load_sharded_model
    from paged_jax.parallel import ShardingPlan, make_mesh

    save_random_hf_checkpoint(tiny_config("qwen3_moe", eos_token_id=None, **ARCHS["qwen3_moe"]), tmp_path / "float",
                              seed=17)
    checkpoint = save_block_fp8_checkpoint(tmp_path / "float", tmp_path / "fp8", tmp_path / "dequantized",
                                           block=(16, 32))
    model, config = load_model(checkpoint, dtype="float32")
    rng = np.random.default_rng(2)
    seqs = [rng.integers(3, config.vocab_size, size=n).astype(np.int32) for n in SEQ_LENS]
    reference = _forward_logits(model, config, seqs)
    with pytest.raises(ValueError, match=r"block-FP8 experts .*only whole \(enable_expert_parallel\)"):
        ShardingPlan.create(config, make_mesh(4))
    plan = ShardingPlan.create(config, make_mesh(4), expert_parallel=True)
    sharded = load_sharded_model(checkpoint, plan, dtype="float32")
    experts = sharded.model.layers[0].mlp.experts
    for leaf in (experts.down_proj.get_value(), experts.down_proj_scale_inv.get_value()):
        assert leaf.sharding.spec == P("tp", None, None) and leaf.sharding.shard_shape(leaf.shape)[0] == 2
    assert experts.down_proj.get_value().dtype == jnp.float8_e4m3fn
    np.testing.assert_allclose(_forward_logits(sharded, config, seqs), reference, atol=2e-5, rtol=0)
    prompts = [rng.integers(3, 256, size=n).tolist() for n in (5, 18)]
    assert _greedy(checkpoint, prompts, tensor_parallel_size=2, enable_expert_parallel=True) == _greedy(checkpoint,
                                                                                                        prompts)


def test_gpt_oss_expert_shares_sum_to_the_whole_layer():
    """gpt-oss's MXFP4 experts split into devices' shares, whole experts (``first_expert``) or a slice of every
    expert's width (contiguous interleaved gate/up columns, the down projection's scale blocks; the down bias added
    once after the sum): the shares sum to the whole layer in the pair-by-pair form of a decode step (the grouped
    form: the model-call test)."""
    import functools

    import jax

    from models import gpt_oss
    from models.quantization import mxfp4

    rng = np.random.default_rng(0)
    num_experts, hidden, inter, top_k, tp = 8, 32, 64, 2, 2
    gate_up, down = (mxfp4.Mxfp4Experts(*map(jnp.asarray, mxfp4.quantize(rng.normal(0, 0.3, shape).astype(
        np.float32)))) for shape in ((num_experts, 2 * inter, hidden), (num_experts, hidden, inter)))
    gate_up_bias, down_bias = (jnp.asarray(rng.normal(0, 0.5, shape), jnp.float32)
                               for shape in ((num_experts, 2 * inter), (num_experts, hidden)))
    run = functools.partial(gpt_oss.gpt_oss_experts, "auto", 1.702, 7.0)
    width, size = inter // tp, num_experts // tp

    def width_share(d):
        cols = slice(2 * width * d, 2 * width * (d + 1))
        blocks = slice(width // 32 * d, width // 32 * (d + 1))
        return (mxfp4.Mxfp4Experts(gate_up.blocks[:, cols], gate_up.scales[:, cols]), gate_up_bias[:, cols],
                mxfp4.Mxfp4Experts(down.blocks[:, :, blocks], down.scales[:, :, blocks]), None, jnp.int32(0))

    @jax.jit
    def whole_and_shares(x, weights, ids):
        operands = (gate_up, gate_up_bias, down, down_bias)
        by_experts = sum(run(x, weights, ids, *jax.tree.map(lambda a: a[d * size:(d + 1) * size], operands),
                             jnp.int32(d * size)) for d in range(tp))
        by_width = sum(run(x, weights, ids, *width_share(d)) for d in range(tp))
        by_width += gpt_oss.combine_top_k(down_bias[ids.reshape(-1)], weights)
        return run(x, weights, ids, *operands), by_experts, by_width

    x = jnp.asarray(rng.standard_normal((1, hidden)), jnp.float32)
    weights, ids = gpt_oss.route_top_k_softmax(jnp.asarray(rng.standard_normal((1, num_experts))), top_k)
    assert gpt_oss.mxfp4_form("auto", "xla", ids.size, size) == "matvec"
    whole, *shares = whole_and_shares(x, weights, ids)
    for share in shares:
        np.testing.assert_allclose(np.asarray(share), np.asarray(whole), rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def gpt_oss_mxfp4(checkpoints, tmp_path_factory):
    from models.quantization.testing import save_mxfp4_gpt_oss_checkpoint

    return save_mxfp4_gpt_oss_checkpoint(checkpoints["gpt_oss"], tmp_path_factory.mktemp("gpt_oss_mxfp4"))


@pytest.mark.parametrize("experts", ["float", "mxfp4"])
def test_gpt_oss_model_call_equals_one_device(checkpoints, gpt_oss_mxfp4, experts):
    """gpt-oss's logits (attention sinks, sliding and full layers, biases; float or MXFP4 experts) on tp = 2 with
    and without expert parallelism, tp = 4 with it and tp = 8 with q heads padded (their sinks too) equal one
    device's: the sinks split with their q heads, the router whole, the experts split by width or whole."""
    from models.tensor_parallel import load_sharded_model
    from paged_jax.parallel import ShardingPlan, make_mesh

    checkpoint = checkpoints["gpt_oss"] if experts == "float" else gpt_oss_mxfp4
    model, config = load_model(checkpoint, dtype="float32")
    rng = np.random.default_rng(2)
    seqs = [rng.integers(3, config.vocab_size, size=n).astype(np.int32) for n in SEQ_LENS]
    reference = _forward_logits(model, config, seqs)
    down = "down_proj" if experts == "float" else "down_proj_blocks"
    layouts = ((2, True), (8, False)) if experts == "float" else ((2, False), (4, True))
    for tp, expert_parallel in layouts:
        plan = ShardingPlan.create(config, make_mesh(tp), expert_parallel=expert_parallel)
        sharded = load_sharded_model(checkpoint, plan, dtype="float32")
        attn, block = sharded.model.layers[0].self_attn, sharded.model.layers[0].mlp
        sinks = attn.sinks.get_value()
        assert sinks.sharding.spec == P("tp") and sinks.shape == (plan.model_config.num_attention_heads,)
        assert attn.o_proj.bias.get_value().sharding.spec == block.router.bias.get_value().sharding.spec == P()
        assert block.expert_parallel.whole_experts == expert_parallel
        spec = getattr(block.experts, down).get_value().sharding.spec  # split over E, or over I (its scale blocks)
        assert list(spec).index("tp") == (0 if expert_parallel else 2 if experts == "mxfp4" else 1)
        assert block.experts.down_proj_bias.get_value().sharding.spec == (P("tp", None) if expert_parallel else P())
        np.testing.assert_allclose(_forward_logits(sharded, config, seqs), reference, atol=2e-5, rtol=0)


def test_gpt_oss_engine_greedy_equals_one_device_model(gpt_oss_mxfp4):
    """gpt-oss's engine at tp = 2, MXFP4 experts split by width: each device's paged attention takes its q heads'
    sinks (sliding and full layers in their KV-cache groups); the greedy tokens are the one-device model's picks."""
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 256, size=n).tolist() for n in (5, 18)]
    outputs = _greedy(gpt_oss_mxfp4, prompts, tensor_parallel_size=2)
    assert _one_device_picks(gpt_oss_mxfp4, prompts, outputs)
