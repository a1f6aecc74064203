"""Test helpers: tiny Hugging Face configs and random HF checkpoints written with transformers (test-only deps).

``tiny_config`` needs nothing; ``save_random_hf_checkpoint`` imports torch/transformers lazily.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

_MODEL_TYPES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",
    "Phi3ForCausalLM": "phi3",
    "GraniteForCausalLM": "granite",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "GptOssForCausalLM": "gpt_oss",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "Llama4ForCausalLM": "llama4_text",
}

# Short names accepted by tiny_config, for readability in tests.
_ALIASES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "granite": "GraniteForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "llama4": "Llama4ForCausalLM",
}

# Each family's own fields in a tiny config: windows, scales and caps small enough to matter at this size (a cap
# of 30 would never bend the tiny model's logits), rope bases that differ per layer kind; the mixture-of-experts
# ones get 8 experts, 2 per token (Qwen3-MoE as published in Qwen3-30B-A3B's config.json: "num_experts", a dense
# intermediate_size beside the experts' 32, renormalized).
_FAMILY_FIELDS = {
    "Gemma2ForCausalLM": {"hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 24,
                          "sliding_window": 8, "attn_logit_softcapping": 0.5, "final_logit_softcapping": 0.3,
                          "tie_word_embeddings": True, "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0},
    "Gemma3ForCausalLM": {"hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 24,
                          "sliding_window": 8, "sliding_window_pattern": 3, "rope_local_base_freq": 100.0,
                          "rope_theta": 10000.0, "tie_word_embeddings": True, "bos_token_id": 2, "eos_token_id": 1,
                          "pad_token_id": 0, "attn_logit_softcapping": None, "final_logit_softcapping": None},
    "Phi3ForCausalLM": {"original_max_position_embeddings": 16, "pad_token_id": 0, "sliding_window": None},
    "GraniteForCausalLM": {"embedding_multiplier": 12.0, "attention_multiplier": 0.1, "residual_multiplier": 0.3,
                           "logits_scaling": 4.0},
    "MixtralForCausalLM": {"sliding_window": None, "num_local_experts": 8, "num_experts_per_tok": 2},
    "Qwen3MoeForCausalLM": {"use_sliding_window": False, "sliding_window": None, "num_experts": 8,
                            "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True,
                            "decoder_sparse_step": 1, "mlp_only_layers": []},
    # gpt-oss as published (openai/gpt-oss-20b's config.json fields), at a size where each part matters: an 8-token
    # window on alternating layers, YaRN stretching an original context of 32, 4 experts of 64 (MXFP4 needs
    # multiples of 32), 2 per token.
    "GptOssForCausalLM": {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"],
                          "num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 64,
                          "attention_bias": True, "swiglu_limit": 7.0, "rms_norm_eps": 1e-5,
                          "max_position_embeddings": 256,
                          "rope_scaling": {"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                           "truncate": False, "original_max_position_embeddings": 32}},
    # DeepSeek (the published configs' fields): latent attention with a q bottleneck, 8 experts in 4 groups, 2 per
    # token, one shared expert, the first layer dense; V2 group-limited softmax routing, V3 sigmoid noaux_tc with
    # YaRN and DeepSeek's mscale.
    "DeepseekV2ForCausalLM": {"num_key_value_heads": 4, "head_dim": 8, "q_lora_rank": 24, "kv_lora_rank": 16,
                              "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 12,
                              "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
                              "moe_intermediate_size": 32, "first_k_dense_replace": 1, "n_group": 4, "topk_group": 2,
                              "topk_method": "group_limited_greedy", "scoring_func": "softmax",
                              "routed_scaling_factor": 1.5, "norm_topk_prob": False},
    "DeepseekV3ForCausalLM": {"num_key_value_heads": 4, "head_dim": 8, "q_lora_rank": 24, "kv_lora_rank": 16,
                              "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 12,
                              "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
                              "moe_intermediate_size": 32, "first_k_dense_replace": 1, "n_group": 4, "topk_group": 2,
                              "topk_method": "noaux_tc", "scoring_func": "sigmoid", "routed_scaling_factor": 2.5,
                              "norm_topk_prob": True, "rope_interleave": True, "num_nextn_predict_layers": 0,
                              "max_position_embeddings": 256,
                              "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32, "beta_slow": 1,
                                               "mscale": 1.0, "mscale_all_dim": 0.7071,
                                               "original_max_position_embeddings": 64}},
    # Llama 4 (meta-llama/Llama-4-Scout-17B-16E's text config.json fields) at a size where each part matters: 4
    # layers (three chunked RoPE layers with the q/k norm, one NoPE full layer with the attention temperature, whose
    # floor_scale of 4 makes it vary), 12-token chunks (edges inside 8-token blocks), llama3 RoPE scaling, sparse
    # layers 1 and 3 (4 experts, top-1, a shared expert) beside dense MLPs of intermediate_size_mlp.
    "Llama4ForCausalLM": {"num_hidden_layers": 4, "attention_chunk_size": 12, "no_rope_layer_interval": 4,
                          "use_qk_norm": True, "attn_temperature_tuning": True, "floor_scale": 4, "attn_scale": 0.1,
                          "interleave_moe_layer_step": 2, "num_local_experts": 4, "num_experts_per_tok": 1,
                          "intermediate_size": 64, "intermediate_size_mlp": 128, "rms_norm_eps": 1e-5,
                          "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
                          "pad_token_id": 0},
}


def tiny_config(architecture: str = "LlamaForCausalLM", **overrides: Any) -> dict[str, Any]:
    """A tiny HF ``config.json`` dict: vocab 256, hidden 64, 2 layers, 4 heads, 2 kv heads, head_dim 16.

    Args:
      architecture: one of ``models.config.SUPPORTED_ARCHITECTURES`` or its short name ("llama", "mistral",
        "qwen2", "qwen3", "gemma2", "gemma3" (the text model), "phi3", "granite", "qwen3_moe", "mixtral",
        "gpt_oss", "deepseek_v2", "deepseek_v3", "llama4" (the text model)); a family's
        own fields get small values that make them matter (``_FAMILY_FIELDS``).
      overrides: fields to set or replace (e.g. ``tie_word_embeddings=True``, ``rope_scaling={...}``).
    """
    architecture = _ALIASES.get(architecture, architecture)
    if architecture not in _MODEL_TYPES:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: {', '.join(_MODEL_TYPES)}")
    config: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": _MODEL_TYPES[architecture],
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "hidden_act": "silu",
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "attention_dropout": 0.0,
    }
    if architecture == "MistralForCausalLM":
        config["sliding_window"] = None
    if architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        config["use_sliding_window"] = False
        config["sliding_window"] = None
    if architecture.startswith("Gemma"):
        del config["hidden_act"]  # Gemma reads hidden_activation
    config.update(_FAMILY_FIELDS.get(architecture, {}))
    config.update(overrides)
    return config


def save_random_hf_checkpoint(hf_config: dict[str, Any], out_dir: str | os.PathLike, *, shards: int = 1,
                              seed: int = 0, dtype=None) -> Path:
    """Build the transformers model for ``hf_config`` with random weights and save it as an HF checkpoint.

    Writes ``config.json`` and ``model.safetensors`` (``shards == 1``) or ``model-0000i-of-0000n.safetensors`` +
    ``model.safetensors.index.json`` (``shards > 1``). Weights are drawn with std 0.02 (norm weights perturbed
    around 1 so a wrong norm mapping is visible; mixture-of-experts routers with std 1, so each token's experts are
    chosen by clear margins). ``dtype`` is a torch dtype (default torch.float32). Tensors are named as published
    checkpoints name them (transformers' own reverse conversion: one tensor per expert and projection).
    Returns the output directory.
    """
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    dtype = torch.float32 if dtype is None else dtype
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    config_dict = dict(hf_config)
    model_type = config_dict.pop("model_type")
    torch_config = AutoConfig.for_model(model_type, **config_dict)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        torch_model = AutoModelForCausalLM.from_config(torch_config, dtype=torch.float32)
        for name, param in torch_model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=generator))
            elif name.endswith(("mlp.gate.weight", "mlp.router.weight", "mlp.router.bias", "self_attn.sinks",
                                "feed_forward.router.weight")):
                # an experts' router; gpt-oss's attention sinks, large enough to take a share of the softmax
                param.copy_(torch.randn(param.shape, generator=generator))
            else:
                param.copy_(0.02 * torch.randn(param.shape, generator=generator))
        for name, buffer in torch_model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's: shifts which experts are chosen
                buffer.copy_(0.5 * torch.randn(buffer.shape, generator=generator))
    torch_model.eval()

    tied = bool(hf_config.get("tie_word_embeddings", False))
    state_dict = {
        name: tensor.detach().to(dtype).contiguous().clone()
        for name, tensor in revert_weight_conversion(torch_model, torch_model.state_dict()).items()
        if not (tied and name == "lm_head.weight") and not name.endswith("rotary_emb.inv_freq")
    }

    names = list(state_dict)
    if shards == 1:
        save_file(state_dict, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        per_shard = -(-len(names) // shards)
        for shard_idx in range(shards):
            shard_names = names[shard_idx * per_shard:(shard_idx + 1) * per_shard]
            shard_file = f"model-{shard_idx + 1:05d}-of-{shards:05d}.safetensors"
            save_file({n: state_dict[n] for n in shard_names}, str(out_dir / shard_file), metadata={"format": "pt"})
            weight_map.update({n: shard_file for n in shard_names})
        total_size = sum(t.numel() * t.element_size() for t in state_dict.values())
        index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))

    saved_config = dict(hf_config)
    saved_config["torch_dtype"] = str(dtype).removeprefix("torch.")
    (out_dir / "config.json").write_text(json.dumps(saved_config, indent=2))
    return out_dir


def write_hub_cache(cache_dir: str | os.PathLike, repo_id: str, files_by_commit: dict[str, dict[str, Any]],
                    refs: dict[str, str]) -> Path:
    """Write huggingface_hub's cache layout for a model repo, as a download would have left it.

    ``<cache_dir>/models--<org>--<name>/``: ``snapshots/<commit>/<file>`` links into ``blobs/``, and ``refs/<ref>``
    holding a commit hash. ``files_by_commit[commit][file]`` is the file's bytes, or a path whose file becomes the
    blob (linked, not copied, so real checkpoints cost nothing). Returns the repo's cache directory.
    """
    repo_dir = Path(cache_dir) / ("models--" + repo_id.replace("/", "--"))
    (repo_dir / "refs").mkdir(parents=True, exist_ok=True)
    (repo_dir / "blobs").mkdir(exist_ok=True)
    for commit, files in files_by_commit.items():
        snapshot = repo_dir / "snapshots" / commit
        snapshot.mkdir(parents=True)
        for name, content in files.items():
            blob = repo_dir / "blobs" / f"{commit[:12]}-{name}"
            if isinstance(content, bytes):
                blob.write_bytes(content)
            else:
                blob.symlink_to(Path(content).resolve())
            (snapshot / name).symlink_to(blob)
    for ref, commit in refs.items():
        (repo_dir / "refs" / ref).write_text(commit)
    return repo_dir


def save_truncated_checkpoint(src_dir: str | os.PathLike, out_dir: str | os.PathLike, num_layers: int) -> Path:
    """A copy of the checkpoint at ``src_dir`` keeping its first ``num_layers`` decoder layers (and its embedding,
    final norm, head and tokenizer files): a draft model with the same vocabulary (speculative decoding tests)."""
    import re
    import shutil

    from safetensors.numpy import load_file, save_file

    src, out = Path(src_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for file in sorted(src.glob("*.safetensors")):
        for name, tensor in load_file(str(file)).items():
            layer = re.search(r"\.layers\.(\d+)\.", name)
            if layer is None or int(layer.group(1)) < num_layers:
                tensors[name] = tensor
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["num_hidden_layers"] = num_layers
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for file in src.glob("tokenizer*"):
        shutil.copy(file, out / file.name)
    return out


def save_random_eagle3_head(target_hf_config: dict[str, Any], out_dir: str | os.PathLike, *,
                            draft_vocab_size: int = 64, intermediate_size: int | None = None, seed: int = 0) -> Path:
    """A random EAGLE-3 head for a target of ``target_hf_config`` in the published layout (``models.eagle3``):
    ``config.json`` (architecture ``LlamaForCausalLMEagle3``) and ``model.safetensors`` with ``midlayer.*``, ``fc``,
    ``norm``, ``lm_head``, ``d2t`` (a random subset of the target vocabulary, in order) and ``t2d``; no embedding
    (the target's is shared). Weights ~ N(0, 0.02) (norms around 1), float32."""
    import numpy as np

    from models.eagle import save_head_checkpoint

    rng = np.random.default_rng(seed)
    hidden, vocab = target_hf_config["hidden_size"], target_hf_config["vocab_size"]
    heads, kv_heads = target_hf_config["num_attention_heads"], target_hf_config["num_key_value_heads"]
    head_dim = target_hf_config.get("head_dim") or hidden // heads
    inter = intermediate_size or target_hf_config["intermediate_size"]
    shapes = {"fc.weight": (hidden, 3 * hidden), "norm.weight": (hidden,), "lm_head.weight": (draft_vocab_size, hidden),
              "midlayer.self_attn.q_proj.weight": (heads * head_dim, 2 * hidden),
              "midlayer.self_attn.k_proj.weight": (kv_heads * head_dim, 2 * hidden),
              "midlayer.self_attn.v_proj.weight": (kv_heads * head_dim, 2 * hidden),
              "midlayer.self_attn.o_proj.weight": (hidden, heads * head_dim),
              "midlayer.mlp.gate_proj.weight": (inter, hidden), "midlayer.mlp.up_proj.weight": (inter, hidden),
              "midlayer.mlp.down_proj.weight": (hidden, inter)}
    for norm in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        shapes[f"midlayer.{norm}.weight"] = (hidden,)
    tensors = {name: ((1.0 if name.endswith("norm.weight") else 0.0) + 0.02 * rng.standard_normal(shape)
                      ).astype(np.float32) for name, shape in shapes.items()}
    targets = np.sort(rng.choice(vocab, draft_vocab_size, replace=False))
    tensors["d2t"] = (targets - np.arange(draft_vocab_size)).astype(np.int64)
    tensors["t2d"] = np.isin(np.arange(vocab), targets)
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": hidden,
              "intermediate_size": inter, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
              "head_dim": head_dim, "num_hidden_layers": 1, "vocab_size": vocab, "draft_vocab_size": draft_vocab_size,
              "target_hidden_size": hidden, "rms_norm_eps": target_hf_config.get("rms_norm_eps", 1e-5),
              "rope_theta": target_hf_config.get("rope_theta", 10000.0),
              "rope_scaling": target_hf_config.get("rope_scaling"),
              "max_position_embeddings": target_hf_config.get("max_position_embeddings", 2048),
              "tie_word_embeddings": False}
    return save_head_checkpoint(tensors, config, out_dir)


def save_random_eagle_head(target_hf_config: dict[str, Any], out_dir: str | os.PathLike, *,
                           intermediate_size: int | None = None, num_layers: int = 1, fc_bias: bool = False,
                           seed: int = 0) -> Path:
    """A random EAGLE head for a target of ``target_hf_config`` in the published layout (``models.eagle``):
    ``config.json`` as the published heads have it (architecture ``LlamaForCausalLM``, one layer) and
    ``model.safetensors`` with ``fc`` (and ``fc.bias`` with ``fc_bias``) and ``layers.*`` (no
    ``layers.0.input_layernorm``), no embedding or LM head (the target's are shared). float32; weights ~ N(0, 0.02),
    norms around 1, except ``fc``: identity plus noise on the embedding half, N(0, 0.002) on the hidden-state half,
    so the head mostly proposes the token it is fed while the target's hidden state still moves its logits (a target
    restricted to a few tokens accepts some of its drafts)."""
    import numpy as np

    from models.eagle import save_head_checkpoint

    rng = np.random.default_rng(seed)
    hidden, heads = target_hf_config["hidden_size"], target_hf_config["num_attention_heads"]
    kv_heads = target_hf_config["num_key_value_heads"]
    head_dim = target_hf_config.get("head_dim") or hidden // heads
    inter = intermediate_size or target_hf_config["intermediate_size"]
    shapes = {}
    for i in range(num_layers):
        shapes.update({f"layers.{i}.self_attn.q_proj.weight": (heads * head_dim, hidden),
                       f"layers.{i}.self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
                       f"layers.{i}.self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
                       f"layers.{i}.self_attn.o_proj.weight": (hidden, heads * head_dim),
                       f"layers.{i}.mlp.gate_proj.weight": (inter, hidden),
                       f"layers.{i}.mlp.up_proj.weight": (inter, hidden),
                       f"layers.{i}.mlp.down_proj.weight": (hidden, inter),
                       f"layers.{i}.post_attention_layernorm.weight": (hidden,)})
        if i:
            shapes[f"layers.{i}.input_layernorm.weight"] = (hidden,)
    tensors = {name: ((1.0 if name.endswith("norm.weight") else 0.0) + 0.02 * rng.standard_normal(shape)
                      ).astype(np.float32) for name, shape in shapes.items()}
    tensors["fc.weight"] = np.concatenate([np.eye(hidden) + 0.02 * rng.standard_normal((hidden, hidden)),
                                           0.002 * rng.standard_normal((hidden, hidden))], axis=1).astype(np.float32)
    if fc_bias:
        tensors["fc.bias"] = (0.02 * rng.standard_normal(hidden)).astype(np.float32)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
              "intermediate_size": inter, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
              "head_dim": head_dim, "num_hidden_layers": num_layers, "vocab_size": target_hf_config["vocab_size"],
              "rms_norm_eps": target_hf_config.get("rms_norm_eps", 1e-5),
              "rope_theta": target_hf_config.get("rope_theta", 10000.0),
              "rope_scaling": target_hf_config.get("rope_scaling"),
              "max_position_embeddings": target_hf_config.get("max_position_embeddings", 2048),
              "hidden_act": "silu", "tie_word_embeddings": False}
    return save_head_checkpoint(tensors, config, out_dir)


def save_random_mtp_checkpoint(hf_config: dict[str, Any], out_dir: str | os.PathLike, *, seed: int = 0,
                               own_head: bool = True) -> Path:
    """A random DeepSeek-V3 checkpoint of ``hf_config`` (``num_hidden_layers`` L) with one multi-token prediction
    layer in the published layout (``models.mtp``): the decoder tensors of ``model.layers.L.*`` (transformers'
    DeepSeek-V3 layer L of an (L + 1)-layer model, drawn as ``save_random_hf_checkpoint`` draws them), its
    ``enorm`` / ``hnorm`` / ``shared_head.norm`` (around 1), ``eh_proj`` [H, 2H] (std 0.02), ``shared_head.head``
    [V, H] (std 0.02; with ``own_head``) and ``embed_tokens`` (the target's, as published); config.json says
    ``num_nextn_predict_layers`` 1. float32."""
    import numpy as np
    from safetensors.numpy import load_file, save_file

    layer = hf_config["num_hidden_layers"]
    out = save_random_hf_checkpoint({**hf_config, "num_hidden_layers": layer + 1, "num_nextn_predict_layers": 0},
                                    out_dir, seed=seed)
    tensors = load_file(str(out / "model.safetensors"))
    rng = np.random.default_rng(seed)
    hidden, vocab = hf_config["hidden_size"], hf_config["vocab_size"]
    prefix = f"model.layers.{layer}."
    extra = {"enorm.weight": 1 + 0.1 * rng.standard_normal(hidden),
             "hnorm.weight": 1 + 0.1 * rng.standard_normal(hidden),
             "eh_proj.weight": 0.02 * rng.standard_normal((hidden, 2 * hidden)),
             "shared_head.norm.weight": 1 + 0.1 * rng.standard_normal(hidden),
             "embed_tokens.weight": tensors["model.embed_tokens.weight"]}
    if own_head:
        extra["shared_head.head.weight"] = 0.02 * rng.standard_normal((vocab, hidden))
    tensors.update({prefix + name: np.ascontiguousarray(t, np.float32) for name, t in extra.items()})
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "num_hidden_layers": layer, "num_nextn_predict_layers": 1},
                                                indent=2))
    return out
