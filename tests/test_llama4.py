"""Llama 4's text model (Llama4ForCausalLM, and the text part of Llama4ForConditionalGeneration checkpoints) against
transformers on tiny random checkpoints (fp32, CPU): the config read as Llama4TextConfig reads it, logits over
several attention chunks, and greedy decoding through the engine in one continuous batch (prompts of two to three
chunks, chunked prefill across a chunk edge, prefix-cache hits, preemption), the chunked layers' KV-cache groups
holding only the current chunk's blocks. Unimplemented fields are refused by name."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import paged_jax
from models.attention import dense_causal_attention
from models.config import AttentionChunk, ModelConfig
from models.llama4 import Llama4MoeBlock
from models.loader import load_model
from models.testing import save_random_hf_checkpoint, tiny_config
from paged_jax import SamplingParams
from paged_jax.config import EngineArgs
from paged_jax.core.kv_cache_manager import NULL_BLOCK_ID
from paged_jax.engine.llm_engine import LLMEngine

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

CHUNK = 12  # tiny_config("llama4")'s attention_chunk_size
BLOCK_SIZE = 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(checkpoint dir, the transformers model in fp32 eager attention)."""
    path = save_random_hf_checkpoint(tiny_config("llama4"), tmp_path_factory.mktemp("llama4"), seed=4)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                                 attn_implementation="eager").eval()
    return path, hf_model


def test_config_reads_as_transformers():
    raw = tiny_config("llama4", num_hidden_layers=8)
    config = ModelConfig.from_hf_config(raw)
    hf_config = transformers.Llama4TextConfig(**{k: v for k, v in raw.items()
                                                 if k not in ("architectures", "model_type")})
    chunked = [kind == "chunked_attention" for kind in hf_config.layer_types]
    assert [chunk is not None for chunk in config.layer_chunks] == chunked
    assert config.layer_chunks == (CHUNK, CHUNK, CHUNK, None) * 2
    assert config.layer_kv_spans == (AttentionChunk(CHUNK),) * 3 + (None,) + (AttentionChunk(CHUNK),) * 3 + (None,)
    assert config.nope_layers == tuple(i for i, rope in enumerate(hf_config.no_rope_layers) if not rope) == (3, 7)
    assert [config.moe.is_sparse(i) for i in range(8)] == [i in hf_config.moe_layers for i in range(8)]
    assert config.intermediate_size == hf_config.intermediate_size_mlp
    assert config.moe.moe_intermediate_size == config.moe.shared_expert_intermediate_size == 64
    assert config.rope_interleaved and config.qk_l2_norm and config.attn_temperature == (4.0, 0.1)
    assert config.rope_scaling["rope_type"] == "llama3" and config.rope_theta == 10000.0
    explicit = ModelConfig.from_hf_config(tiny_config("llama4", moe_layers=[0], no_rope_layers=[1, 0, 1, 1],
                                                      attention_chunk_size=None))
    assert explicit.layer_chunks == (None,) * 4 and explicit.nope_layers == (1,)
    assert [explicit.moe.is_sparse(i) for i in range(4)] == [True, False, False, False]


def test_scout_preset():
    """The Llama-4-Scout-17B-16E text shape: 109B parameters with its vision tower (about 1B), 17B active."""
    from benchmarks.floors import active_body_params, embedding_params, lm_head_params
    from models.presets import num_params, preset_config

    config = preset_config("llama-4-scout-17b-16e")
    assert config.layer_chunks == (8192, 8192, 8192, None) * 12 and config.nope_layers == tuple(range(3, 48, 4))
    assert all(config.moe.is_sparse(i) for i in range(48)) and config.intermediate_size == 16384
    assert 107e9 < num_params(config) < 109e9
    assert 16.5e9 < active_body_params(config) + embedding_params(config) + lm_head_params(config) < 17.5e9


REFUSED = {
    "sliding_layer": (tiny_config("llama4", layer_types=["sliding_attention"] * 4), "layer_types"),
    "bad_chunk": (tiny_config("llama4", attention_chunk_size=0), "attention_chunk_size"),
    "moe_layer_out_of_range": (tiny_config("llama4", moe_layers=[1, 9]), "moe_layers"),
    "no_rope_flags": (tiny_config("llama4", no_rope_layers=[1, 2, 1, 0]), "no_rope_layers"),
    "sliding_window": (tiny_config("llama4", sliding_window=8), "sliding_window"),
    "activation": (tiny_config("llama4", hidden_act="gelu"), "hidden_act"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_unimplemented_config_is_refused_naming_the_field(case):
    hf_config, field = REFUSED[case]
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_hf_config(hf_config)


def _logits(model, config, seqs):
    input_ids = np.concatenate(seqs)
    positions = np.concatenate([np.arange(len(s), dtype=np.int32) for s in seqs])
    segments = np.concatenate([np.full(len(s), i, dtype=np.int32) for i, s in enumerate(seqs)])

    @jax.jit
    def run(ids, pos, seg):
        hidden, _ = model(ids, pos, None, dense_causal_attention(seg, config.head_dim ** -0.5, positions=pos))
        return model.compute_logits(hidden)

    return np.asarray(run(jnp.asarray(input_ids), jnp.asarray(positions), jnp.asarray(segments)))


def _seqs(n=(30, 1, 37)):
    rng = np.random.default_rng(0)
    return [rng.integers(3, 256, size=k).astype(np.int32) for k in n]


def test_logits_match_transformers(checkpoint):
    path, hf_model = checkpoint
    model, config = load_model(path, dtype="float32")
    assert [isinstance(layer.mlp, Llama4MoeBlock) for layer in model.model.layers] == [False, True, False, True]
    seqs = _seqs()
    with torch.no_grad():
        reference = np.concatenate([hf_model(torch.tensor(s[None].astype(np.int64))).logits[0].numpy() for s in seqs])
    assert np.abs(reference).max() > 0.1
    np.testing.assert_allclose(_logits(model, config, seqs), reference, atol=1e-4, rtol=0)


def test_text_part_of_a_multimodal_checkpoint_loads(checkpoint, tmp_path):
    """A Llama4ForConditionalGeneration checkpoint as published: the text config under ``text_config``, the text
    model's tensors under ``language_model.``, the vision tower's beside them (not loaded)."""
    from safetensors.numpy import load_file, save_file

    path, hf_model = checkpoint
    tensors = {f"language_model.{name}": value for name, value in load_file(str(path / "model.safetensors")).items()}
    tensors["vision_model.patch_embedding.linear.weight"] = np.zeros((8, 4), np.float32)
    tensors["multi_modal_projector.linear_1.weight"] = np.zeros((4, 8), np.float32)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    text_config = json.loads((path / "config.json").read_text())
    config = {"architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4",
              "text_config": {k: v for k, v in text_config.items() if k != "architectures"},
              "vision_config": {"model_type": "llama4_vision_model", "hidden_size": 8}, "image_token_index": 200092}
    (tmp_path / "config.json").write_text(json.dumps(config))
    model, loaded = load_model(tmp_path, dtype="float32")
    assert loaded == ModelConfig.from_pretrained(path)
    seqs = _seqs((29,))
    with torch.no_grad():
        reference = hf_model(torch.tensor(seqs[0][None].astype(np.int64))).logits[0].numpy()
    np.testing.assert_allclose(_logits(model, loaded, seqs), reference, atol=1e-4, rtol=0)


def _hf_greedy(hf_model, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                                eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_engine_greedy_matches_transformers_with_prefix_hits(checkpoint):
    """One continuous batch: prompts of two to three chunks, chunked prefill in 16-token steps (chunks end inside
    and across a chunk edge), then a prompt sharing 16 tokens (two full blocks) with one of them: a prefix-cache hit
    whose chunked groups need only the block of the chunk of position 16 (tokens 12..)."""
    path, hf_model = checkpoint
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 256, size=n).tolist() for n in (25, 30, 27, 36)]
    prompts.append(prompts[1][:16] + [5, 6, 7])
    max_tokens = 8
    llm = paged_jax.LLM(model=str(path), dtype="float32", max_model_len=64, block_size=BLOCK_SIZE,
                        enable_chunked_prefill=True, max_num_batched_tokens=16, max_num_seqs=8,
                        enable_prefix_caching=True, use_tqdm=False)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], params, use_tqdm=False)
    (shared,) = llm.generate([{"prompt_token_ids": prompts[4]}], params, use_tqdm=False)
    assert shared.num_cached_tokens == 16
    ours = [list(out.outputs[0].token_ids) for out in [*first, shared]]
    assert ours == [_hf_greedy(hf_model, p, max_tokens) for p in prompts]


@pytest.mark.parametrize("mode,async_scheduling", [("recompute", False), ("swap", True)])
def test_engine_greedy_matches_transformers_under_preemption(checkpoint, mode, async_scheduling):
    """A pool too small for the batch (30 blocks: a 64-token sequence needs 8 full and 3 x 5 chunked ones):
    preemption. The three chunked groups hold at most ceil(12 / 8) + 1 = 3 blocks of a decoding request (the blocks
    before its chunk's start freed), the full group every block; greedy fp32 tokens equal transformers'."""
    path, hf_model = checkpoint
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 256, size=n).tolist() for n in (25, 30, 27, 36, 29)]
    max_tokens = 14
    engine = LLMEngine(EngineArgs(model=str(path), dtype="float32", max_model_len=64, block_size=BLOCK_SIZE,
                                  max_num_batched_tokens=16, max_num_seqs=8, num_gpu_blocks_override=30,
                                  preemption_mode=mode, **({"swap_space": 0.01} if mode == "swap" else {}),
                                  async_scheduling=async_scheduling, seed=0), use_tqdm=False)
    core = engine.engine_core
    kv = core.kv_cache_manager
    assert kv.group_windows == (None, AttentionChunk(CHUNK), AttentionChunk(CHUNK), AttentionChunk(CHUNK))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params)
    tokens: dict[str, list[int]] = {}
    most_held = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens.setdefault(output.request_id, []).extend(output.outputs[0].token_ids)
        for request in core.scheduler.running:
            if request.num_computed_tokens <= request.num_prompt_tokens:
                continue  # a prefill chunk's step holds more (max_blocks_per_request)
            full = request.block_ids[0::4]
            assert NULL_BLOCK_ID not in full
            for g in (1, 2, 3):
                most_held = max(most_held, sum(b != NULL_BLOCK_ID for b in request.block_ids[g::4]))
    assert 2 <= most_held <= -(-CHUNK // BLOCK_SIZE) + 1
    assert core.stats()["num_preemptions"] > 0
    if mode == "swap":
        assert core.stats()["num_swap_outs"] > 0
    assert [tokens[f"r{i}"] for i in range(len(prompts))] == [_hf_greedy(hf_model, p, max_tokens) for p in prompts]
    assert kv.num_free_blocks == kv.num_usable_blocks and kv.num_free_host_blocks == kv.num_host_blocks
    assert core.runner.num_compiles_since_warmup == 0


def test_mosaic_attention_and_parallelism_are_refused(checkpoint):
    """The Mosaic kernel has no chunked attention; the fused gate/up experts have no pipeline-stage layout (tensor
    and expert parallelism: tests/test_expert_parallel.py)."""
    from paged_jax.parallel.pipeline import PipelinePlan

    path, _ = checkpoint
    with pytest.raises(ValueError, match=r"^attention_impl: 'mosaic' does not take the chunked local attention"):
        paged_jax.LLM(model=str(path), dtype="float32", attention_impl="mosaic", max_model_len=64, use_tqdm=False)
    config = ModelConfig.from_hf_config(tiny_config("llama4"))
    with pytest.raises(ValueError, match="^pipeline_parallel_size=2: Llama4ForCausalLM's fused gate/up experts"):
        PipelinePlan.create(config, 2, 1)


def test_chat_image_parts_are_refused_naming_the_field():
    """The server takes text only (a Llama4ForConditionalGeneration checkpoint is served as its text model): a chat
    message's image part is a 400 naming ``messages`` and the part's type."""
    from fastapi.exceptions import RequestValidationError
    from pydantic import ValidationError

    from serving.errors import validation_error
    from serving.protocol import ChatCompletionRequest

    image = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
    body = {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "what is it?"}, image]}]}
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate(body)
    errors = [{**error, "loc": ("body", *error["loc"])} for error in info.value.errors()]
    refusal = validation_error(RequestValidationError(errors))
    assert refusal.status_code == 400 and refusal.param == "messages"
    assert refusal.message == ("messages.0.content: Value error, content part type 'image_url' is not supported: the "
                               "model takes text inputs only (no images or audio)")
    text_only = {**body, "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    assert ChatCompletionRequest.model_validate(text_only).messages[0].content[0].text == "hi"
