"""A checkpoint's ``generation_config.json`` as default sampling parameters, the way vLLM reads it.

vLLM's ``--generation-config``: ``auto`` reads the model's own file, ``vllm`` ignores it (vLLM's built-in defaults),
a directory reads that directory's file. The sampling fields found there become the defaults of requests that do not
set them (``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``, and ``max_new_tokens`` as
``max_tokens``); its ``eos_token_id`` adds to the config's EOS ids.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

FILE_NAME = "generation_config.json"
# generation_config.json key -> SamplingParams field.
SAMPLING_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                 "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def read_generation_config(mode: str, model_path: str | os.PathLike | None) -> dict[str, Any]:
    """The generation config selected by ``mode``, as the keys that differ from transformers' defaults
    (``GenerationConfig.to_diff_dict()``, as vLLM reads it); {} when there is none.

    Args:
      mode: "auto" (the model directory's file), "vllm" (none) or a directory holding ``generation_config.json``.
      model_path: the model's local directory (None for shapes without a checkpoint).
    Raises:
      ValueError naming ``generation_config`` when ``mode`` is a directory without the file, or the file is invalid.
    """
    if mode == "vllm":
        return {}
    if mode == "auto":
        if model_path is None or not (Path(model_path) / FILE_NAME).is_file():
            return {}
        directory = Path(model_path)
    else:
        directory = Path(mode)
        if not (directory / FILE_NAME).is_file():
            raise ValueError(f"generation_config {mode!r} must be 'auto', 'vllm' or a directory containing "
                             f"{FILE_NAME}")
    from transformers import GenerationConfig  # only with a file: importing transformers takes seconds

    try:
        return GenerationConfig.from_pretrained(str(directory)).to_diff_dict()
    except (OSError, ValueError) as exc:
        raise ValueError(f"generation_config: {directory / FILE_NAME} cannot be read ({exc})") from exc


def sampling_defaults(generation_config: dict[str, Any]) -> dict[str, Any]:
    """The ``SamplingParams`` defaults a generation config sets: ``{field: value}`` for the keys it has."""
    defaults = {field: generation_config[key] for key, field in SAMPLING_KEYS.items()
                if generation_config.get(key) is not None}
    if defaults:
        logger.info("default sampling parameters from the generation config: %s (a request's own values win; "
                    "--generation-config vllm ignores the file)", defaults)
    return defaults


def eos_token_ids(generation_config: dict[str, Any]) -> list[int]:
    """The EOS ids a generation config names (int or list), as a list."""
    value = generation_config.get("eos_token_id")
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [int(v) for v in value]
    return []
