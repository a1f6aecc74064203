"""Where a checkpoint comes from: a local directory or a Hugging Face Hub repo id (vLLM's `MODEL` argument).

A repo id is fetched with ``huggingface_hub.snapshot_download`` into the Hub cache (``HF_HOME`` /
``HF_HUB_CACHE``, or ``download_dir``), fetching only the files the engine reads: the config, the generation config,
the safetensors weights and the tokenizer files. ``HF_HUB_OFFLINE=1`` resolves from the cache alone. Progress bars
are huggingface_hub's own.
"""

from __future__ import annotations

import os
from pathlib import Path

# What the engine reads from a checkpoint: config, weights, tokenizer (and the chat template beside it).
CONFIG_PATTERNS = ("config.json", "generation_config.json")
WEIGHT_PATTERNS = ("*.safetensors", "*.safetensors.index.json")
# A speculative decoding draft head may be published as a pytorch_model.bin only (the EAGLE repository's heads).
HEAD_WEIGHT_PATTERNS = WEIGHT_PATTERNS + ("pytorch_model.bin",)
TOKENIZER_PATTERNS = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                      "tokenizer.model", "vocab.json", "vocab.txt", "merges.txt", "chat_template.jinja",
                      "chat_template.json", "preprocessor_config.json")


def hub_offline() -> bool:
    """True when ``HF_HUB_OFFLINE`` asks for cache-only resolution (read at call time, not at import)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def resolve_checkpoint(model: str | os.PathLike, *, revision: str | None = None, download_dir: str | None = None,
                       what: str = "model", field: str = "model") -> Path:
    """Local directory of ``model``: the path itself, or the Hub snapshot of a repo id (downloaded if needed).

    Args:
      model: a local directory, or a Hub repo id such as ``"Qwen/Qwen3-0.6B"``.
      revision: branch, tag or commit of the repo (``None``: the default branch); refused with a local path.
      download_dir: Hub cache directory to use instead of huggingface_hub's default.
      what: ``"model"`` (config, weights and tokenizer), ``"draft_head"`` (config and weights, safetensors or a
        ``pytorch_model.bin``: ``models.loader.read_checkpoint_tensors``) or ``"tokenizer"`` (config and tokenizer
        files only).
      field: the flag or argument name to cite in errors (``"model"``, ``"tokenizer"``).
    Raises:
      ValueError naming ``field`` when the path does not exist and is not a repo id, when the repo or revision
      cannot be found (or is not cached while offline), or when a model repo has no safetensors weights (a draft
      head repo no weights).
    """
    path = Path(os.fspath(model)).expanduser()
    if path.is_dir():
        if revision is not None:
            raise ValueError(f"revision ({revision!r}) applies to Hub repo ids only; {field} {str(model)!r} is a "
                             f"local directory")
        return path
    name = os.fspath(model)
    check_directory_or_repo_id(name, field)
    snapshot = _download(name, revision=revision, download_dir=download_dir, what=what, field=field)
    if what == "model" and not any(snapshot.glob("*.safetensors")):
        raise ValueError(f"{field} {name!r} has no safetensors weights (only safetensors checkpoints load)")
    has_bin = (snapshot / "pytorch_model.bin").is_file()
    if what == "draft_head" and not any(snapshot.glob("*.safetensors")) and not has_bin:
        raise ValueError(f"{field} {name!r} has no weights (model.safetensors or pytorch_model.bin)")
    return snapshot


def check_directory_or_repo_id(name: str, field: str) -> None:
    """Raise a ValueError naming ``field`` when ``name`` is neither a local directory nor shaped like a Hub repo id
    (``org/name`` or ``name``): a path that does not exist, found without reading the Hub."""
    if not Path(name).expanduser().is_dir() and not _looks_like_repo_id(name):
        raise ValueError(f"{field} {name!r} is neither a local directory nor a Hugging Face Hub repo id")


def _looks_like_repo_id(name: str) -> bool:
    parts = name.split("/")
    return 1 <= len(parts) <= 2 and all(parts) and not name.startswith((".", "~")) and "\\" not in name


def _download(repo_id: str, *, revision: str | None, download_dir: str | None, what: str, field: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError, RepositoryNotFoundError, \
        RevisionNotFoundError

    patterns = list(CONFIG_PATTERNS + HEAD_WEIGHT_PATTERNS) if what == "draft_head" else \
        list(CONFIG_PATTERNS + TOKENIZER_PATTERNS)
    if what == "model":
        patterns += WEIGHT_PATTERNS
    try:
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=download_dir, allow_patterns=patterns,
                                      local_files_only=hub_offline()))
    except LocalEntryNotFoundError as exc:
        raise ValueError(f"{field} {repo_id!r} (revision {revision or 'main'}) is not in the Hub cache and the Hub "
                         f"cannot be reached (HF_HUB_OFFLINE={os.environ.get('HF_HUB_OFFLINE', '')!r}): {exc}"
                         ) from exc
    except RevisionNotFoundError as exc:
        raise ValueError(f"revision {revision!r} not found in {repo_id!r}: {exc}") from exc
    except (RepositoryNotFoundError, HFValidationError) as exc:
        raise ValueError(f"{field} {repo_id!r} is not a Hub repo this machine can read: {exc}") from exc
