"""Load Hugging Face safetensors checkpoints (single file or sharded) into the model class of their architecture
(``models.architectures``).

The model is first built abstractly (``nnx.eval_shape``: shapes only, no memory), then every parameter is read
tensor by tensor from the checkpoint, checked, cast and placed on the device, so the weights are never held twice.
Reading uses ``safetensors`` with ``framework="numpy"``; bfloat16 tensors (which numpy lacks) are decoded from the
raw bytes with ``ml_dtypes``. No torch is needed at run time. A mixture-of-experts checkpoint stores each expert's
projections as its own tensor (as published on the Hub); they are stacked into one ``[E, in, out]`` parameter.
A multimodal checkpoint whose text model is supported (Llama 4's ``Llama4ForConditionalGeneration``) loads its
``language_model.`` tensors only.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import re
from pathlib import Path
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors import safe_open
from tqdm.auto import tqdm

from models.architectures import model_class
from models.config import ModelConfig
from models.deepseek import CHECKPOINT_LEAVES as DEEPSEEK_LEAVES
from models.gpt_oss import CHECKPOINT_LEAVES
from models.llama4 import EXPERT_PARAMS as LLAMA4_EXPERT_PARAMS
from models.llama import INIT_STD, LlamaForCausalLM
from models.moe import checkpoint_prefix, expert_checkpoint_names
from models.quantization import block_fp8

logger = logging.getLogger(__name__)

_DTYPES = {
    "bfloat16": jnp.bfloat16,
    "bf16": jnp.bfloat16,
    "float16": jnp.float16,
    "fp16": jnp.float16,
    "half": jnp.float16,
    "float32": jnp.float32,
    "fp32": jnp.float32,
    "float": jnp.float32,
}
LOAD_FORMATS = ("auto", "safetensors", "dummy")
MXFP4_DUMMY_SCALE = 120  # e8m0 exponent 120 - 127: 2 ** -7
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
PYTORCH_FILE = "pytorch_model.bin"
# Checkpoint tensors the model intentionally has no parameter for.
_IGNORABLE_TENSOR = re.compile(r"(^|\.)rotary_emb\.inv_freq$")
# A multimodal checkpoint's text model: its tensors' prefix (the others, e.g. the vision tower's, are not loaded).
TEXT_MODEL_PREFIX = "language_model."
# Checkpoint tensors that hold several model parameters stacked along their rows (HF's output dim), per
# architecture: fused name suffix -> its parts' name suffixes, in row order. The loader splits them, so the model
# keeps one layout (the engine fuses projections itself, after loading: models.llama.fuse_projections).
_FUSED_CHECKPOINT_TENSORS = {
    "Phi3ForCausalLM": {
        "self_attn.qkv_proj.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
        "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    },
}

# safetensors dtype tag -> numpy dtype, for decoding raw bytes.
_SAFETENSORS_NUMPY_DTYPES = {
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F16": np.dtype(np.float16),
    "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
}


# Tensor dtypes numpy's safetensors reader cannot build (bf16; FP8 of quantized checkpoints): read as raw bytes.
_RAW_DTYPES = {"BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn)}


def resolve_dtype(dtype: Any) -> jnp.dtype:
    """Map "bfloat16"/"float16"/"float32" (or a jnp dtype) to a jnp dtype; ValueError otherwise."""
    if isinstance(dtype, str):
        if dtype.lower() not in _DTYPES:
            raise ValueError(f"dtype {dtype!r} is unsupported; use one of bfloat16, float16, float32")
        return jnp.dtype(_DTYPES[dtype.lower()])
    resolved = jnp.dtype(dtype)
    if resolved not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)):
        raise ValueError(f"dtype {dtype!r} is unsupported; use one of bfloat16, float16, float32")
    return resolved


def load_model(path: str | os.PathLike | None, *, dtype: Any = "bfloat16", load_format: str = "auto", seed: int = 0,
               config: ModelConfig | None = None) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Build the model of a Hugging Face checkpoint directory (``models.architectures.model_class``: a
    ``LlamaForCausalLM`` or a subclass).

    Args:
      path: directory with ``config.json`` and ``model.safetensors`` or ``model.safetensors.index.json`` + shards.
        May be None with ``load_format="dummy"`` and ``config=``.
      dtype: compute and parameter dtype ("bfloat16", "float16", "float32" or a jnp dtype).
      load_format: "auto"/"safetensors" read weights; "dummy" initializes randomly (N(0, 0.02)) from the config
        alone, directly on the device.
      seed: RNG seed for "dummy".
      config: use this config instead of reading ``<path>/config.json``.
    Returns:
      (model, config).
    Raises:
      FileNotFoundError: config.json or weight files missing (the path is named).
      ValueError: unsupported architecture/dtype/load_format, a tensor with the wrong shape, a missing or
        unexpected tensor, or an unreadable (e.g. truncated) safetensors file.
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format {load_format!r} is unsupported; use one of {', '.join(LOAD_FORMATS)}")
    jnp_dtype = resolve_dtype(dtype)
    if config is None:
        if path is None:
            raise ValueError("load_model needs a checkpoint path or config=")
        config = ModelConfig.from_pretrained(path)
    if load_format == "dummy":
        return init_dummy_model(config, dtype=jnp_dtype, seed=seed), config
    if path is None:
        raise ValueError(f"load_format={load_format!r} needs a checkpoint path")
    tensor_files = checkpoint_tensor_files(Path(path))
    return _load_safetensors(config, tensor_files, jnp_dtype), config


def init_dummy_model(config: ModelConfig, *, dtype=jnp.bfloat16, seed: int = 0) -> LlamaForCausalLM:
    """Random weights (N(0, 0.02) matrices, norms 1, biases 0) generated directly on the default device.

    Parameters are generated one at a time by a jitted sampler compiled once per distinct (shape, dtype, fill), so
    even an 8B model is created in seconds, never exists on the host, and peaks at its own size plus one tensor.
    Parameter ``i`` (flat state order) is ``dummy_param_value(fold_in(key(seed), i), ...)``.
    """
    graphdef, flat_state = abstract_flat_state(config, dtype)
    base_key = jax.random.key(seed)
    for index, (param_path, variable) in enumerate(flat_state):
        spec = variable.get_value()
        variable.set_value(_dummy_param_jit(jax.random.fold_in(base_key, index), spec.shape, spec.dtype,
                                            dummy_fill(param_path, config)))
    return nnx.merge(graphdef, nnx.from_flat_state(flat_state))


def dummy_fill(param_path: tuple, config: ModelConfig) -> float | None:
    """The constant a "dummy" parameter is filled with (norm scales 1, or 0 for Gemma's norms, which scale by
    1 + weight; biases 0; MXFP4 scales 2 ** -7, so random fp4 blocks give weights of about N(0, 0.02)'s size;
    block-FP8 experts' scales 1, their float8 weights drawn as N(0, 0.02)), or None for a random one."""
    leaf = str(param_path[-1])
    if leaf.endswith("_scales"):
        return float(MXFP4_DUMMY_SCALE)
    if leaf.endswith(block_fp8.SCALE_SUFFIX):
        return 1.0
    if leaf == "scale":
        return 0.0 if config.norm_unit_offset else 1.0
    return 0.0 if leaf == "bias" else None


def dummy_param_value(key: jax.Array, shape: tuple[int, ...], dtype, fill: float | None) -> jax.Array:
    """One "dummy" parameter, ``dtype[shape]``: ``fill`` everywhere, or (fill None) ``N(0, INIT_STD)`` drawn in
    float32 from ``key`` then cast (random bits for an integer dtype: packed MXFP4 blocks). Traceable, so a sharded
    loader can generate it inside its own jit."""
    if fill is not None:
        return jnp.full(shape, fill, dtype)
    if jnp.issubdtype(dtype, jnp.integer):
        return jax.random.bits(key, shape, dtype)
    return (jax.random.normal(key, shape, jnp.float32) * INIT_STD).astype(dtype)


_dummy_param_jit = jax.jit(dummy_param_value, static_argnames=("shape", "dtype", "fill"))


def abstract_flat_state(config: ModelConfig, dtype) -> tuple[nnx.GraphDef, nnx.FlatState]:
    """(graphdef, flat state of ShapeDtypeStruct variables) of ``model_class(config)(config)`` with parameters in
    ``dtype``: shapes only, no memory."""
    cls = model_class(config)
    abstract_model = nnx.eval_shape(lambda: cls(config, dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(0)))
    graphdef, abstract_state = nnx.split(abstract_model)
    return graphdef, nnx.to_flat_state(abstract_state)


def checkpoint_tensor_files(model_dir: Path) -> dict[str, Path]:
    """Map tensor name -> safetensors file for a single-file or sharded checkpoint.

    Raises FileNotFoundError (naming the path) when there are no weights or a listed shard is missing."""
    index_path = model_dir / INDEX_FILE
    single_path = model_dir / SINGLE_FILE
    if index_path.is_file():
        with open(index_path) as f:
            try:
                weight_map = json.load(f)["weight_map"]
            except (json.JSONDecodeError, KeyError) as exc:
                raise ValueError(f"{index_path} is not a valid safetensors index (needs 'weight_map'): {exc}") from exc
        files = {name: model_dir / shard for name, shard in weight_map.items()}
        for shard in sorted(set(files.values())):
            if not shard.is_file():
                raise FileNotFoundError(f"checkpoint shard listed in {index_path} not found: {shard}")
        return files
    if single_path.is_file():
        with _open_safetensors(single_path) as f:
            return {name: single_path for name in f.keys()}
    raise FileNotFoundError(f"no weights found: expected {single_path} or {index_path}")


def read_checkpoint_tensors(model_dir: Path) -> dict[str, np.ndarray]:
    """Every tensor of a single-file or sharded safetensors checkpoint, as stored (HF layout, checkpoint dtype,
    numpy; bf16 / fp8 through ``ml_dtypes``): for small checkpoints read whole (speculative decoding's draft heads,
    which may also come as a ``pytorch_model.bin`` alone: read with torch, when installed, weights only).
    FileNotFoundError / ValueError as ``checkpoint_tensor_files`` and ``_read_tensor``."""
    model_dir = Path(model_dir)
    if not any(model_dir.glob("*.safetensors")) and (model_dir / PYTORCH_FILE).is_file():
        return _read_pytorch_file(model_dir / PYTORCH_FILE)
    by_file: dict[Path, list[str]] = {}
    for name, file_path in checkpoint_tensor_files(Path(model_dir)).items():
        by_file.setdefault(file_path, []).append(name)
    tensors = {}
    for file_path, names in by_file.items():
        with _open_safetensors(file_path) as handle:
            tensors.update((name, _read_tensor(handle, name, file_path)) for name in names)
    return tensors


def _read_pytorch_file(path: Path) -> dict[str, np.ndarray]:
    try:
        import torch
    except ImportError:
        raise ValueError(f"{path}: reading a pytorch_model.bin needs torch installed (or convert the checkpoint to "
                         "safetensors)") from None
    tensors = {}
    for name, tensor in torch.load(path, map_location="cpu", weights_only=True).items():
        if tensor.dtype == torch.bfloat16:  # numpy has no bfloat16: the same bytes as ml_dtypes'
            tensors[name] = tensor.contiguous().view(torch.int16).numpy().view(_RAW_DTYPES["BF16"])
        else:
            tensors[name] = tensor.contiguous().numpy()
    return tensors


class _open_safetensors:
    """``safe_open(path, framework="numpy")`` that turns header/format errors into ValueError naming the file."""

    def __init__(self, path: Path):
        self.path = path

    def __enter__(self):
        try:
            self._ctx = safe_open(str(self.path), framework="numpy")
            return self._ctx.__enter__()
        except Exception as exc:  # safetensors raises SafetensorError (not a ValueError subclass)
            raise ValueError(f"cannot read safetensors file {self.path}: {exc}") from exc

    def __exit__(self, *exc_info):
        return self._ctx.__exit__(*exc_info)


def _read_tensor(handle, name: str, path: Path) -> np.ndarray:
    """Read one tensor as numpy; bf16 goes through raw bytes since numpy has no bfloat16."""
    try:
        tensor_slice = handle.get_slice(name)
        dtype_tag = tensor_slice.get_dtype()
        if dtype_tag in _RAW_DTYPES:
            shape = tuple(tensor_slice.get_shape())
            # get_slice()[...] on a numpy handle cannot build bf16 / fp8; decode the raw bytes with ml_dtypes.
            return _read_raw(path, name, shape, _RAW_DTYPES[dtype_tag])
        return handle.get_tensor(name)
    except ValueError:
        raise
    except Exception as exc:
        raise ValueError(f"cannot read tensor {name!r} from {path}: {exc}") from exc


def _safetensors_header(path: Path) -> tuple[int, dict]:
    stat = path.stat()
    return _cached_header(path, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=8)
def _cached_header(path: Path, mtime_ns: int, size: int) -> tuple[int, dict]:
    """(data start offset, header dict); keyed by mtime/size so a rewritten file is re-read."""
    with open(path, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_len))
    return 8 + header_len, header


def _read_raw(path: Path, name: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    data_start, header = _safetensors_header(path)
    begin, end = header[name]["data_offsets"]
    with open(path, "rb") as f:
        f.seek(data_start + begin)
        raw = f.read(end - begin)
    if len(raw) != end - begin:
        raise ValueError(f"safetensors file {path} is truncated while reading tensor {name!r}")
    return np.frombuffer(raw, dtype=dtype).reshape(shape)


def hf_name_for(param_path: tuple) -> tuple[str, bool]:
    """Model parameter path -> (HF tensor name, whether the HF tensor is the transpose of ours)."""
    *prefix, leaf = (str(p) for p in param_path)
    if leaf in CHECKPOINT_LEAVES or leaf in DEEPSEEK_LEAVES or leaf in LLAMA4_EXPERT_PARAMS:  # own names and layouts
        return ".".join(prefix + [leaf]), False
    if leaf == "kernel":
        return ".".join(prefix + ["weight"]), True
    if leaf in ("scale", "embedding"):
        return ".".join(prefix + ["weight"]), False
    if leaf == "bias":
        return ".".join(prefix + ["bias"]), False
    raise ValueError(f"no checkpoint mapping for model parameter {'.'.join(map(str, param_path))}")


def checkpoint_tensor_shapes(config: ModelConfig, param_path: tuple,
                             shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
    """The checkpoint tensors ``(name, shape as stored)`` that the model parameter ``param_path`` (of model-layout
    ``shape``) is read from: one, or one ``[out, in]`` tensor per expert of stacked experts."""
    expert_names = expert_checkpoint_names(config, param_path)
    if expert_names is not None:
        scales = str(param_path[-1]).endswith(block_fp8.SCALE_SUFFIX)  # stored as the model holds them
        return [(name, tuple(shape[1:] if scales else shape[1:][::-1])) for name in expert_names]
    name, transposed = hf_name_for(param_path)
    return [(checkpoint_prefix(config, name), tuple(shape[::-1]) if transposed else tuple(shape))]


def to_model_layout(array, transposed: bool):
    """A tensor as ``iter_checkpoint_params`` yields it -> model layout: its last two axes swapped when
    ``transposed`` (a ``[out, in]`` weight, or ``[E, out, in]`` stacked experts, -> ``[..., in, out]``)."""
    return array.swapaxes(-1, -2) if transposed else array


def iter_checkpoint_params(tensor_files: dict[str, Path], expected_shapes: dict[tuple, tuple[int, ...]],
                           config: ModelConfig) -> Iterator[tuple[tuple, np.ndarray, bool]]:
    """Read the checkpoint tensor of every model parameter, one at a time, file by file.

    Args:
      tensor_files: from ``checkpoint_tensor_files``.
      expected_shapes: model parameter path -> its shape in model layout (``[in, out]`` kernels), e.g. from
        ``abstract_flat_state``.
      config: the checkpoint's config (for the error messages, tied embeddings and expert names).
    Yields:
      ``(param_path, array, transposed)``: the tensor as stored (HF layout, checkpoint dtype, numpy) and whether
      the model parameter is its transpose (``to_model_layout``). Stacked experts come as ``[E, out, in]``, the
      experts' tensors stacked. The host holds one tensor (one stack) at a time.
    Raises:
      ValueError: before reading anything, a missing tensor or an unexpected one (other than ignorable ones and a
        tied model's redundant ``lm_head.weight``); while reading, a tensor whose shape is not the expected one or
        an unreadable file.
    """
    wanted: dict[str, tuple[tuple, bool]] = {}  # hf name -> (param path, transposed), one tensor per parameter
    stacks: dict[tuple, list[str]] = {}  # param path -> its experts' hf names (stacked)
    for param_path in expected_shapes:
        expert_names = expert_checkpoint_names(config, param_path)
        if expert_names is not None:
            stacks[param_path] = expert_names
        else:
            hf_name, transposed = hf_name_for(param_path)
            wanted[checkpoint_prefix(config, hf_name)] = (param_path, transposed)
    if _is_base_model_checkpoint(tensor_files):
        wanted = {name.removeprefix("model."): value for name, value in wanted.items()}
    elif TEXT_MODEL_PREFIX + "model.embed_tokens.weight" in tensor_files:  # the text part of a multimodal one
        tensor_files = {name: path for name, path in tensor_files.items() if name.startswith(TEXT_MODEL_PREFIX)}
        wanted = {TEXT_MODEL_PREFIX + name: value for name, value in wanted.items()}
    fused = _fused_sources(config.architecture, wanted, tensor_files)
    dequantize = _block_fp8_dequantizer(tensor_files, config)
    stacked = set().union(*stacks.values())
    tensor_files = _without_skipped_tensors(tensor_files, config, stacked)
    _check_tensor_names(tensor_files, set(wanted) | stacked, fused, config)
    yield from _read_tensors(tensor_files, expected_shapes, wanted, fused, dequantize)
    # Block-FP8 experts stay in float8 beside their scales (MoeConfig.expert_format "fp8"): read as stored.
    fp8_experts = config.moe is not None and config.moe.expert_format == "fp8"
    yield from _read_expert_stacks(tensor_files, expected_shapes, stacks,
                                   (lambda hf_name, array: array) if fp8_experts else dequantize)


def _without_skipped_tensors(tensor_files: dict[str, Path], config: ModelConfig, stacked: set[str]
                             ) -> dict[str, Path]:
    """``tensor_files`` less what the model reads otherwise or not at all: a block-FP8 checkpoint's
    ``weight_scale_inv`` tensors (read with their weights; but the ``stacked`` ones, block-FP8 experts' scales, are
    parameters of their own) and DeepSeek-V3's multi-token prediction layers (``num_nextn_predict_layers``, the
    layers after the last decoder layer: skipped, with a log line; the ``mtp`` drafter reads them, ``models.mtp``)."""
    if config.fp8_weight_block is not None:
        tensor_files = {name: path for name, path in tensor_files.items()
                        if name in stacked or not name.endswith(".weight" + block_fp8.SCALE_SUFFIX)}
    if config.mla is None:
        return tensor_files
    mtp = re.compile(r"^model\.layers\.(\d+)\.")
    skipped = {name for name in tensor_files
               if (match := mtp.match(name)) and int(match.group(1)) >= config.num_hidden_layers}
    if skipped:
        logger.info("Skipping %d tensors of the multi-token prediction layers (num_nextn_predict_layers, layers >= "
                    "%d): the speculative method 'mtp' reads them (models.mtp)", len(skipped), config.num_hidden_layers)
    return {name: path for name, path in tensor_files.items() if name not in skipped}


def _block_fp8_dequantizer(tensor_files: dict[str, Path], config: ModelConfig):
    """``fn(hf_name, array) -> array``: a block-FP8 checkpoint's weight (one with a ``weight_scale_inv``)
    dequantized to float32 (``models.quantization.block_fp8``), any other tensor as read."""
    block = config.fp8_weight_block
    if block is None:
        return lambda hf_name, array: array

    def dequantize(hf_name: str, array: np.ndarray) -> np.ndarray:
        if array.dtype != np.dtype(ml_dtypes.float8_e4m3fn):
            return array
        scale_name = hf_name + block_fp8.SCALE_SUFFIX
        file_path = tensor_files.get(scale_name)
        if file_path is None:
            raise ValueError(f"checkpoint tensor {hf_name!r} is FP8 but has no {scale_name!r}")
        with _open_safetensors(file_path) as handle:
            return block_fp8.dequantize(array, _read_tensor(handle, scale_name, file_path), block)

    return dequantize


def _is_base_model_checkpoint(tensor_files: dict[str, Path]) -> bool:
    """Whether the checkpoint is transformers' base model (``Qwen3Model``, as sentence-transformers saves it): its
    tensor names lack the ``model.`` prefix of the causal-LM and classification checkpoints."""
    return "embed_tokens.weight" in tensor_files and "model.embed_tokens.weight" not in tensor_files


def _check_tensor_names(tensor_files: dict[str, Path], wanted: set[str], fused: dict[str, tuple[str, ...]],
                        config: ModelConfig) -> None:
    """ValueError naming the tensors the model needs and the checkpoint lacks (neither alone nor in a ``fused``
    tensor), or those it has and the model does not read (other than ignorable ones and a tied model's redundant
    ``lm_head.weight``)."""
    missing = sorted(name for name in wanted
                     if name not in tensor_files and not any(name in parts for parts in fused.values()))
    if missing:
        raise ValueError(f"checkpoint is missing tensor(s) {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    unexpected = sorted(
        name for name in tensor_files
        if name not in wanted and name not in fused and not _IGNORABLE_TENSOR.search(name)
        # A tied model may still ship lm_head.weight (a copy of the embedding); it is redundant, not an error.
        and not ((config.tie_word_embeddings or config.head != "lm_head") and name == "lm_head.weight")
    )
    if unexpected:
        raise ValueError(
            f"checkpoint has unexpected tensor(s) {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''} "
            f"for {config.architecture}"
        )


def _read_tensors(tensor_files: dict[str, Path], expected_shapes: dict[tuple, tuple[int, ...]],
                  wanted: dict[str, tuple[tuple, bool]], fused: dict[str, tuple[str, ...]], dequantize
                  ) -> Iterator[tuple[tuple, np.ndarray, bool]]:
    """``iter_checkpoint_params``'s one-tensor parameters, file by file: each ``wanted`` tensor the checkpoint has,
    and each ``fused`` tensor split into the wanted tensors it holds; ``dequantize(name, array)`` applied to each
    tensor read (``_block_fp8_dequantizer``)."""
    def hf_shape(hf_name: str) -> tuple[int, ...]:
        param_path, transposed = wanted[hf_name]
        model_shape = tuple(expected_shapes[param_path])
        return model_shape[::-1] if transposed else model_shape

    names_by_file: dict[Path, list[str]] = {}
    for hf_name in [*(name for name in wanted if name in tensor_files), *fused]:
        names_by_file.setdefault(tensor_files[hf_name], []).append(hf_name)
    for file_path, names in names_by_file.items():
        with _open_safetensors(file_path) as handle:
            for hf_name in names:
                parts = fused.get(hf_name, (hf_name,))
                shapes = [hf_shape(part) for part in parts]
                expected = (sum(shape[0] for shape in shapes), *shapes[0][1:])
                array = dequantize(hf_name, _read_checked(handle, hf_name, file_path, expected))
                offsets = np.cumsum([shape[0] for shape in shapes])[:-1]
                for part, piece in zip(parts, np.split(array, offsets, axis=0)):
                    yield wanted[part][0], piece, wanted[part][1]


def _fused_sources(architecture: str, wanted: dict[str, Any], tensor_files: dict[str, Path]
                   ) -> dict[str, tuple[str, ...]]:
    """Fused checkpoint tensor -> the wanted tensors it holds, in row order (``_FUSED_CHECKPOINT_TENSORS``), for
    each fused tensor the checkpoint has and whose parts it lacks."""
    sources = {}
    for fused_suffix, part_suffixes in _FUSED_CHECKPOINT_TENSORS.get(architecture, {}).items():
        for name in tensor_files:
            if not name.endswith("." + fused_suffix):
                continue
            prefix = name[:-len(fused_suffix)]
            parts = tuple(prefix + suffix for suffix in part_suffixes)
            if all(part in wanted and part not in tensor_files for part in parts):
                sources[name] = parts
    return sources


def _read_expert_stacks(tensor_files: dict[str, Path], expected_shapes: dict[tuple, tuple[int, ...]],
                        stacks: dict[tuple, list[str]], dequantize) -> Iterator[tuple[tuple, np.ndarray, bool]]:
    """``iter_checkpoint_params``'s stacked experts: each parameter's per-expert ``[out, in]`` tensors stacked into
    ``[E, out, in]`` (transposed), a block-FP8 expert's ``weight_scale_inv`` blocks into ``float32[E, out blocks,
    in blocks]`` (as stored, not transposed), the files opened once."""
    with contextlib.ExitStack() as open_files:
        handles: dict[Path, Any] = {}
        for param_path, names in stacks.items():
            transposed = not str(param_path[-1]).endswith(block_fp8.SCALE_SUFFIX)
            expert_shape = tuple(expected_shapes[param_path])[1:]
            expert_shape = expert_shape[::-1] if transposed else expert_shape  # each expert's [out, in]
            experts = []
            for hf_name in names:
                file_path = tensor_files[hf_name]
                if file_path not in handles:
                    handles[file_path] = open_files.enter_context(_open_safetensors(file_path))
                experts.append(dequantize(hf_name, _read_checked(handles[file_path], hf_name, file_path,
                                                                 expert_shape)))
            yield param_path, np.stack(experts), transposed


def _read_checked(handle, hf_name: str, file_path: Path, expected_shape: tuple[int, ...]) -> np.ndarray:
    """One tensor, or a ValueError when its shape is not ``expected_shape``."""
    array = _read_tensor(handle, hf_name, file_path)
    if tuple(array.shape) != expected_shape:
        raise ValueError(f"tensor {hf_name!r} in {file_path} has shape {tuple(array.shape)} but the model "
                         f"expects {expected_shape}")
    return array


def _load_safetensors(config: ModelConfig, tensor_files: dict[str, Path], dtype) -> LlamaForCausalLM:
    graphdef, flat_state = abstract_flat_state(config, dtype)
    variables = dict(flat_state)
    expected_shapes = {param_path: tuple(variable.get_value().shape) for param_path, variable in flat_state}
    device = jax.local_devices()[0]  # this process's (a job may span processes)
    with tqdm(total=len(variables), desc="Loading weights", unit="tensor", leave=False) as progress:
        for param_path, array, transposed in iter_checkpoint_params(tensor_files, expected_shapes, config):
            variable = variables[param_path]
            # Cast and transpose on the device: host keeps only the one tensor being read.
            value = jax.device_put(array, device).astype(variable.get_value().dtype)
            variable.set_value(to_model_layout(value, transposed))
            progress.update(1)
    state = nnx.from_flat_state(flat_state)
    return nnx.merge(graphdef, state)
