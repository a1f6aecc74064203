"""Multi-LoRA serving on SmolLM2 (fp32): PEFT adapters against transformers + PEFT, mixed batches, slot swaps,
prefix-cache isolation, refused adapters, the server's adapter routes through the openai client."""

import argparse
import types

import numpy as np
import pytest

from lora_adapters import ADAPTER_SPECS, make_peft_model, write_adapter
from paged_jax import LLM, LoRARequest, SamplingParams
from paged_jax.config import EngineArgs
from paged_jax.core.kv_cache_manager import KVCacheManager
from paged_jax.engine.input_processor import InputProcessor
from paged_jax.core.request import Request
from paged_jax.core.scheduler import Scheduler

MAX_NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
SHORT = SamplingParams(temperature=0.0, max_tokens=3)
PROMPT = "Once upon a time, there was a"
NAMES = list(ADAPTER_SPECS)


@pytest.fixture(scope="module")
def adapters(smollm2_dir, tmp_path_factory):
    """(PeftModel with every adapter of ADAPTER_SPECS, {name: adapter dir})."""
    return make_peft_model(smollm2_dir, tmp_path_factory.mktemp("adapters"))


@pytest.fixture(scope="module")
def llm():
    # Two slots for three adapters: a step mixes two adapters and the base model, the third waits for a slot. The
    # shapes of tests/test_llm.py's engine: the compilation cache serves the sampler's executables.
    return LLM(enable_lora=True, max_loras=2, max_lora_rank=16, max_cpu_loras=2, max_model_len=256, max_num_seqs=16,
               max_num_batched_tokens=128, num_gpu_blocks_override=400, use_tqdm=False)


def lora_request(name, paths):
    return LoRARequest(name, NAMES.index(name) + 1, paths[name])


@pytest.fixture(scope="module")
def peft_greedy(adapters, smollm2_tokenizer):
    """``peft_greedy(name | None, prompt (text or ids), max_new=MAX_NEW) -> token ids``: transformers + PEFT fp32
    greedy continuation (stops after EOS)."""
    import torch

    peft_model, _ = adapters
    cache = {}

    def run(name, prompt, max_new=MAX_NEW):
        key = (name, prompt if isinstance(prompt, str) else tuple(prompt), max_new)
        if key not in cache:
            ids = torch.tensor([smollm2_tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)])
            with torch.no_grad():
                if name is None:
                    with peft_model.disable_adapter():
                        out = peft_model.generate(ids, max_new_tokens=max_new, do_sample=False, eos_token_id=2,
                                                  pad_token_id=2)
                else:
                    peft_model.set_adapter(name)
                    out = peft_model.generate(ids, max_new_tokens=max_new, do_sample=False, eos_token_id=2,
                                              pad_token_id=2)
            cache[key] = out[0, ids.shape[1]:].tolist()
        return cache[key]

    return run


def assert_idle(engine):
    kv = engine.engine_core.kv_cache_manager
    assert not engine.has_unfinished_requests()
    assert kv.num_free_blocks == kv.num_usable_blocks
    assert engine.engine_core.runner.num_compiles_since_warmup == 0  # slot writes and swaps never recompile


def test_mixed_batch_matches_transformers_peft(llm, adapters, peft_greedy, monkeypatch):
    _, paths = adapters
    engine = llm.llm_engine
    step_slots = []
    execute = engine.engine_core.runner.execute

    def recording_execute(scheduler_output, lora_slots=None, *rest, **kw):
        """Record the adapter slots of each step's rows, as the runner's batch holds them."""
        handle = execute(scheduler_output, lora_slots, *rest, **kw)
        batch = engine.engine_core.runner.input_batch
        lora_ids = [int(batch.lora_int_id[batch.row_of[req_id]]) for req_id in scheduler_output.row_req_ids()]
        step_slots.append({(lora_slots or {}).get(lora_int_id, 0) for lora_int_id in lora_ids})
        return handle

    monkeypatch.setattr(engine.engine_core.runner, "execute", recording_execute)
    names = [None, *NAMES, None]
    prompts = [PROMPT] * 4 + ["The capital of France is"]
    outs = llm.generate(prompts, GREEDY, lora_request=[None if n is None else lora_request(n, paths) for n in names],
                        use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    assert got == [peft_greedy(n, p) for n, p in zip(names, prompts)]
    assert len({tuple(g) for g in got[:4]}) == 4  # every adapter changes the output
    # One step ran the base model and two adapters side by side; the third adapter took a slot later.
    assert any(len(slots - {0}) == 2 and 0 in slots for slots in step_slots)
    assert engine.engine_core.lora_manager.num_slot_writes >= 3
    assert_idle(engine)


def test_prefix_cache_never_shared_across_adapters(llm, adapters):
    _, paths = adapters
    prompt = list(range(100, 140))  # 40 tokens: two full blocks
    first = lora_request(NAMES[0], paths)
    base = llm.generate([prompt], SHORT, use_tqdm=False)[0]
    lora = llm.generate([prompt], SHORT, lora_request=first, use_tqdm=False)[0]
    assert lora.num_cached_tokens == 0  # the base model's blocks are no hit for an adapter
    other = llm.generate([prompt], SHORT, lora_request=lora_request(NAMES[1], paths), use_tqdm=False)[0]
    assert other.num_cached_tokens == 0
    again = llm.generate([prompt], SHORT, lora_request=first, use_tqdm=False)[0]
    assert again.num_cached_tokens == 32 and again.outputs[0].token_ids == lora.outputs[0].token_ids
    assert llm.generate([prompt], SHORT, use_tqdm=False)[0].num_cached_tokens == 32
    assert base.outputs[0].token_ids != lora.outputs[0].token_ids
    assert_idle(llm.llm_engine)


def test_preemption_chunked_prefill_and_async_scheduling(llm, adapters, peft_greedy, monkeypatch):
    """Prompts longer than the step budget (chunked), more KV than the pool holds (recompute preemption), async
    scheduling: each adapter's rows still match transformers + PEFT."""
    _, paths = adapters
    engine = llm.llm_engine
    monkeypatch.setattr(engine.engine_core, "async_scheduling", True)
    prompts = [list(range(300 + 11 * i, 440 + 11 * i)) for i in range(2)]  # 140 tokens: chunks of a 128-token step
    names = [NAMES[0], NAMES[1]]
    preemptions = engine.stats()["num_preemptions"]
    # A hog leaves 19 of the 399 blocks: two prompts (9 blocks each) fit, their growth to 10 blocks each does not.
    hog = Request("hog", [0])
    assert engine.engine_core.kv_cache_manager.allocate_slots(hog, 380 * 16)
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16),
                            lora_request=[None if n is None else lora_request(n, paths) for n in names],
                            use_tqdm=False)
    finally:
        engine.engine_core.kv_cache_manager.free(hog)
    assert [o.outputs[0].token_ids for o in outs] == [peft_greedy(n, p, 16) for n, p in zip(names, prompts)]
    assert engine.stats()["num_preemptions"] > preemptions
    assert_idle(engine)


def _adapter_tensors(rank=4, module="self_attn.q_proj", layer=0, extra=None):
    in_features, out_features = 576, 576
    tensors = {f"base_model.model.model.layers.{layer}.{module}.lora_A.weight": np.zeros((rank, in_features),
                                                                                       np.float32),
               f"base_model.model.model.layers.{layer}.{module}.lora_B.weight": np.zeros((out_features, rank),
                                                                                       np.float32)}
    tensors.update(extra or {})
    return tensors


@pytest.mark.parametrize("config, tensors, message", [
    (dict(r=4, lora_alpha=8, use_dora=True), _adapter_tensors(), "use_dora"),
    (dict(r=4, lora_alpha=8), _adapter_tensors(extra={
        "base_model.model.model.embed_tokens.lora_embedding_A": np.zeros((4, 49152), np.float32)}), "embedding LoRA"),
    (dict(r=32, lora_alpha=8), _adapter_tensors(rank=32), "max_lora_rank=16"),
    (dict(r=4, lora_alpha=8, modules_to_save=["lm_head"]), _adapter_tensors(), "modules_to_save"),
    (dict(r=4, lora_alpha=8), _adapter_tensors(module="self_attn.rotary_proj"), "self_attn.rotary_proj"),
    (dict(r=4, lora_alpha=8), _adapter_tensors(layer=30), "layer 30"),
    (dict(r=4, lora_alpha=8), {"base_model.model.lm_head.lora_A.weight": np.zeros((4, 576), np.float32)},
     "lm_head"),
])
def test_unsupported_adapters_are_refused(llm, tmp_path, config, tensors, message):
    path = write_adapter(tmp_path / "bad", config, tensors)
    with pytest.raises(ValueError, match=message) as info:
        llm.generate([PROMPT], GREEDY, lora_request=LoRARequest("bad", 90, path), use_tqdm=False)
    assert str(info.value).startswith("lora_request")
    assert_idle(llm.llm_engine)  # nothing queued, nothing leaked, the engine serves on


def test_adapter_errors_name_the_problem(llm, tmp_path, adapters):
    _, paths = adapters
    with pytest.raises(ValueError, match="No adapter found"):
        llm.generate([PROMPT], GREEDY, lora_request=LoRARequest("missing", 91, str(tmp_path)), use_tqdm=False)
    llm.llm_engine.add_lora(lora_request(NAMES[0], paths))
    with pytest.raises(ValueError, match="lora_int_id 1 already names adapter"):
        llm.llm_engine.add_lora(LoRARequest("other", 1, paths[NAMES[1]]))
    with pytest.raises(ValueError, match="enable_lora"):
        InputProcessor(llm.llm_engine.info, None, EngineArgs()).process("x", [1], None,
                                                                        lora_request=LoRARequest("a", 1, "/x"))
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("a", 0, "/x")
    assert llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert_idle(llm.llm_engine)


def test_scheduler_admits_at_most_max_loras_adapters():
    kv = KVCacheManager(num_blocks=64, block_size=16)
    scheduler = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=256, max_model_len=64, max_loras=1)
    loras = [types.SimpleNamespace(lora_int_id=i, cache_key=bytes([i])) for i in (1, 2)]
    requests = [Request(f"r{i}", [1, 2, 3], lora=lora) for i, lora in enumerate([loras[0], loras[1], None, loras[0]])]
    for request in requests:
        scheduler.add_request(request)
    first = {s.request.request_id for s in scheduler.schedule().scheduled_rows()}
    assert first == {"r0", "r2", "r3"}  # adapter 2 waits for the slot adapter 1 holds; the base row joins
    for request_id in ("r0", "r3"):
        scheduler.finish_request(request_id, "stop")
    assert "r1" in {s.request.request_id for s in scheduler.schedule().scheduled_rows()}


# ------------------------------------------------------------------------------------------------------- server
@pytest.fixture(scope="module")
def lora_client(llm, adapters, monkeypatch_module):
    """The openai client on an app over the module's engine (its last user), runtime updates allowed, one
    adapter from --lora-modules."""
    import openai
    from starlette.testclient import TestClient

    from serving.app import create_app
    from serving.lora import parse_lora_module

    _, paths = adapters
    for lora_int_id in range(1, len(NAMES) + 1):  # the server numbers its adapters from 1 itself
        llm.llm_engine.remove_lora(lora_int_id)
    monkeypatch_module.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    app = create_app(llm.llm_engine, served_model_name="smollm2",
                     lora_modules=[parse_lora_module(f"static={paths[NAMES[0]]}")])
    http = TestClient(app)
    yield openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0), http
    app.state.server.engine.shutdown()


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def test_server_load_use_unload_adapters(lora_client, adapters, peft_greedy):
    import openai

    client, http = lora_client
    _, paths = adapters
    models = {m.id: m for m in client.models.list().data}
    assert models["static"].parent == "smollm2" and models["static"].root == paths[NAMES[0]]
    answer = http.post("/v1/load_lora_adapter", json={"lora_name": "dyn", "lora_path": paths[NAMES[2]]})
    assert answer.status_code == 200 and answer.text == "Success: LoRA adapter 'dyn' added successfully."
    assert "dyn" in {m.id for m in client.models.list().data}
    for model, name in (("static", NAMES[0]), ("dyn", NAMES[2]), ("smollm2", None)):
        completion = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_NEW, temperature=0)
        assert completion.model == model
        assert completion.choices[0].text == client_decode(http, peft_greedy(name, PROMPT))
    bad = http.post("/v1/load_lora_adapter", json={"lora_name": "dyn", "lora_path": paths[NAMES[1]]})
    assert bad.status_code == 400 and "already been loaded" in bad.json()["error"]["message"]
    missing = http.post("/v1/load_lora_adapter", json={"lora_name": "nope", "lora_path": "/nonexistent"})
    assert missing.status_code == 404
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "dyn"}).status_code == 200
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "dyn"}).status_code == 404
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="dyn", prompt=PROMPT, max_tokens=2)


def client_decode(http, token_ids):
    return http.post("/detokenize", json={"tokens": token_ids}).json()["prompt"]


def test_lora_modules_flag_forms():
    from serving.cli import parse_serve_args
    from serving.lora import LoRAModulePath, parse_lora_module
    from serving.settings import app_kwargs, engine_args_from_namespace

    _, args = parse_serve_args(["--enable-lora", "--max-loras", "3", "--max-lora-rank", "64", "--max-cpu-loras", "5",
                                "--lora-modules", "a=/x", '{"name": "b", "path": "/y"}'])
    engine_args = engine_args_from_namespace(args)
    assert (engine_args.enable_lora, engine_args.max_loras, engine_args.max_lora_rank,
            engine_args.max_cpu_loras) == (True, 3, 64, 5)
    assert app_kwargs(args, engine_args)["lora_modules"] == [LoRAModulePath("a", "/x"), LoRAModulePath("b", "/y")]
    with pytest.raises(ValueError, match="max_cpu_loras"):
        engine_args_from_namespace(parse_serve_args(["--max-loras", "3", "--max-cpu-loras", "2"])[1])

    assert parse_lora_module("a=/x") == LoRAModulePath("a", "/x")
    assert parse_lora_module('{"name": "a", "path": "/x", "base_model_name": "m"}') == LoRAModulePath("a", "/x", "m")
    for bad in ("a", "=/x", '{"name": "a"}', '{"name": "a", "path": "/x", "rank": 4}'):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_lora_module(bad)


# ------------------------------------------------------------------------------------------- tensor parallelism
def test_tensor_parallel_splits_lora_like_the_base_layers():
    """tp=4 on the fake CPU devices (kv heads replicated: the head rewrite applies to the adapter too): the same
    logits as one device, B split over outputs for column-parallel layers, A over inputs for row-parallel ones."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import PartitionSpec as P

    from benchmarks.lora import random_adapter
    from models.attention import dense_causal_attention
    from models.config import ModelConfig
    from models.loader import init_dummy_model
    from models.tensor_parallel import shard_model
    from models.testing import tiny_config
    from paged_jax.lora.slots import LoRASlots
    from paged_jax.parallel import ShardingPlan, make_mesh

    config = ModelConfig.from_hf_config(tiny_config("qwen3", num_attention_heads=8, num_key_value_heads=2,
                                                    hidden_size=64, head_dim=16, intermediate_size=128))
    model = init_dummy_model(config, dtype=jnp.float32, seed=3)
    adapter = random_adapter(config, rank=4, seed=1, std=0.2)
    lora_request = LoRARequest("r", 1, "/random")
    tokens = np.array([5, 17, 99, 3, 250, 64, 8, 11], np.int32)
    positions = np.concatenate([np.arange(5), np.arange(3)]).astype(np.int32)
    segments = np.array([0] * 5 + [1] * 3, np.int32)
    slot_ids = jnp.asarray(np.array([2] * 5 + [0] * 3, np.int32))  # sequence 0 with the adapter, 1 without
    sm_scale = config.head_dim ** -0.5

    single = LoRASlots(config, fused=False, max_loras=2, max_lora_rank=8, dtype=jnp.float32)
    single.write(2, single.to_slot_form(adapter, lora_request))

    @nnx.jit
    def reference(model, arrays, slot_ids):
        attention = dense_causal_attention(segments, sm_scale, positions=positions)
        hidden, _ = model(tokens, positions, None, attention, single.layers(arrays, slot_ids))
        return model.compute_logits(hidden)

    expected = np.asarray(reference(model, single.arrays, slot_ids))
    assert not np.allclose(expected[:5], np.asarray(reference(model, single.arrays, slot_ids * 0))[:5], atol=1e-3)

    plan = ShardingPlan.create(config, make_mesh(4))
    sharded = shard_model(model, plan)
    slots = LoRASlots(plan.model_config, fused=False, max_loras=2, max_lora_rank=8, dtype=jnp.float32,
                      sharding_plan=plan)
    slots.write(2, slots.to_slot_form(adapter, lora_request))
    layer = slots.arrays[0]
    assert layer["q_proj"][1].sharding.spec == P(None, None, "tp") and layer["q_proj"][0].sharding.spec == P()
    assert layer["down_proj"][0].sharding.spec == P("tp", None, None)

    @nnx.jit
    def tensor_parallel(model, arrays, slot_ids):
        def local(layer_idx, q, k, v, kv_layer, metadata):
            return dense_causal_attention(*metadata[:1], sm_scale, positions=metadata[1])(layer_idx, q, k, v,
                                                                                          kv_layer)

        attention = plan.shard_attention(local, (jnp.asarray(segments), jnp.asarray(positions)))
        hidden, _ = model(tokens, positions, None, attention, slots.layers(arrays, slot_ids))
        return model.compute_logits(hidden)

    got = tensor_parallel(sharded, slots.arrays, jax.device_put(slot_ids, plan.replicated))
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.slow  # its own engine process with LoRA slots compiles every executable again: over CI's budget
def test_engine_process_serves_adapters_like_peft(adapters, peft_greedy, smollm2_dir):
    """The default serving mode (the engine in a child process): adapters cross the pipe with their requests, and a
    batch mixing two adapters and the base model gives transformers + PEFT's greedy tokens for each."""
    from paged_jax.config import EngineArgs
    from serving.engine_process import start_engine_process

    _, paths = adapters
    client = start_engine_process(EngineArgs(model=str(smollm2_dir), dtype="float32", enable_lora=True, max_loras=2,
                                            max_lora_rank=16, max_model_len=256, max_num_seqs=4,
                                            max_num_batched_tokens=64, num_gpu_blocks_override=80, seed=0))
    try:
        names = [NAMES[0], None, NAMES[1]]
        client.submit_requests([(f"r{i}", PROMPT, GREEDY, 0, name and lora_request(name, paths))
                                for i, name in enumerate(names)])
        tokens = {f"r{i}": [] for i in range(len(names))}
        while client.has_unfinished_requests():
            for output in client.step():
                tokens[output.request_id] += output.outputs[0].token_ids
        assert [tokens[f"r{i}"] for i in range(len(names))] == [peft_greedy(name, PROMPT) for name in names]
        assert len({tuple(t) for t in tokens.values()}) == len(names)  # each adapter changes the output
    finally:
        client.close()
