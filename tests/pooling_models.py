"""Tiny pooling checkpoints for the pooling tests, written with transformers and sentence-transformers (test-only
dependencies), each with SmolLM2's tokenizer (the model's vocabulary is the tokenizer's)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from models.testing import save_random_hf_checkpoint, tiny_config

SMOLLM2_VOCAB = 49152
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def copy_tokenizer(smollm2_dir, out_dir) -> None:
    for name in _TOKENIZER_FILES:
        if (Path(smollm2_dir) / name).is_file():
            shutil.copy(Path(smollm2_dir) / name, Path(out_dir) / name)


def causal_lm_checkpoint(smollm2_dir, out_dir, architecture: str = "qwen3", **overrides) -> Path:
    """A tiny random ``*ForCausalLM`` with SmolLM2's tokenizer."""
    out = save_random_hf_checkpoint(tiny_config(architecture, vocab_size=SMOLLM2_VOCAB, **overrides), out_dir)
    copy_tokenizer(smollm2_dir, out)
    return out


def sentence_transformer_checkpoint(base_dir, out_dir, pooling_mode: str, normalize: bool):
    """A sentence-transformers model over the base model of ``base_dir`` (saved as the base ``*Model`` with
    ``modules.json`` / ``1_Pooling``); returns ``(its directory, the SentenceTransformer)``."""
    from sentence_transformers import SentenceTransformer

    try:  # sentence-transformers >= 6
        from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer
    except ImportError:
        from sentence_transformers.models import Normalize, Pooling, Transformer

    hidden_size = json.loads((Path(base_dir) / "config.json").read_text())["hidden_size"]
    modules = [Transformer(str(base_dir)), Pooling(hidden_size, pooling_mode=pooling_mode)]
    if normalize:
        modules.append(Normalize())
    model = SentenceTransformer(modules=modules, device="cpu")
    model.save(str(out_dir))
    return Path(out_dir), model


def classifier_checkpoint(smollm2_dir, out_dir, num_labels: int, architecture: str = "qwen3"):
    """A tiny random ``*ForSequenceClassification`` (transformers' head: ``score``); returns ``(its directory, the
    transformers model)``."""
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification

    config = tiny_config(architecture, vocab_size=SMOLLM2_VOCAB)
    model_type = config.pop("model_type")
    config["architectures"] = [config["architectures"][0].replace("ForCausalLM", "ForSequenceClassification")]
    hf_config = AutoConfig.for_model(model_type, num_labels=num_labels, **config)
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(hf_config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn(param.shape))
            else:
                param.copy_(0.02 * torch.randn(param.shape) * (50.0 if name == "score.weight" else 1.0))
    model.save_pretrained(str(out_dir))
    copy_tokenizer(smollm2_dir, out_dir)
    with open(Path(out_dir) / "config.json") as f:
        assert json.load(f)["architectures"][0].endswith("ForSequenceClassification")
    return Path(out_dir), model
