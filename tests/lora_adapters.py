"""Random PEFT LoRA adapters of SmolLM2 for the LoRA tests, made by PEFT itself (so the files are PEFT's format),
with non-zero B matrices (PEFT initializes B to zeros, which would make an adapter a no-op)."""

from __future__ import annotations

import json
from pathlib import Path

# name -> LoraConfig keywords: different ranks, targets, scalings (rsLoRA) and layer subsets.
ADAPTER_SPECS = {
    "attn-r8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    "all-r4-rslora": dict(r=4, lora_alpha=8, use_rslora=True,
                          target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                          "down_proj"]),
    "mlp-r16-even-layers": dict(r=16, lora_alpha=32, target_modules=["o_proj", "gate_proj", "up_proj", "down_proj"],
                                layers_to_transform=list(range(0, 30, 2))),
}


def make_peft_model(model_dir, out_dir: Path, seed: int = 0, std: float = 0.1):
    """A fp32 transformers SmolLM2 wrapped in a ``PeftModel`` holding every adapter of ``ADAPTER_SPECS`` (random A
    and B), each saved under ``out_dir/<name>``. Returns ``(peft_model, {name: path})``."""
    import torch
    from peft import LoraConfig, PeftModel
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    base.eval()
    peft_model = None
    for name, spec in ADAPTER_SPECS.items():
        config = LoraConfig(lora_dropout=0.0, **spec)
        if peft_model is None:
            peft_model = PeftModel(base, config, adapter_name=name)
        else:
            peft_model.add_adapter(name, config)
    with torch.no_grad():
        for module in peft_model.modules():
            for name in getattr(module, "lora_B", {}):
                torch.nn.init.normal_(module.lora_B[name].weight, std=std)
    paths = {}
    for name in ADAPTER_SPECS:
        peft_model.save_pretrained(str(out_dir), selected_adapters=[name])
        # PEFT saves a non-default adapter under out_dir/<name>.
        paths[name] = str(out_dir / name)
        assert (Path(paths[name]) / "adapter_config.json").is_file()
    peft_model.eval()
    return peft_model, paths


def write_adapter(out_dir: Path, config: dict, tensors: dict) -> str:
    """A hand-made adapter directory (for adapters PEFT would not write the way a test needs)."""
    from safetensors.numpy import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", **config}))
    save_file(tensors, str(out_dir / "adapter_model.safetensors"))
    return str(out_dir)
