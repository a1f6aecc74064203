"""Converted-weights cache: a checkpoint's first load in a given layout is saved with orbax, later loads restore it.

Converting an HF safetensors checkpoint into the engine's parameters (parse, transpose, cast, fuse projections or
rewrite heads and shard) is done once per (checkpoint, dtype, layout). ``load_or_convert`` then saves the resulting
parameter pytree with orbax under ``<cache>/weights/<checkpoint dir name>-<key hash>/`` (``state/`` = the orbax
checkpoint, ``key.json`` = the key, for inspection); a later load with the same key restores every leaf straight into
its target sharding, without opening a safetensors file.

The key (``cache_key``) holds the resolved checkpoint path, the size and mtime of every file the conversion reads
(``config.json``, ``*.safetensors``, the shard index), the dtype, the caller's layout description and
``FORMAT_VERSION``: a rewritten checkpoint gets a new key, never a stale entry. Bump ``FORMAT_VERSION`` whenever the
conversion's output changes for the same inputs (a new fusion, a new parameter layout).

Atomicity and concurrency: an entry is written into a hidden staging directory and committed by one ``os.rename``
onto the entry's name, so a crashed or half-written save is never at a name that is restored. Two processes
converting at once each write their own staging directory; the first rename wins and the other discards its copy.
A stored entry that fails to restore is moved aside, and the weights are converted and cached again. After each save,
entries whose checkpoint is gone or has changed (they can never be hit again) and staging directories older than
a day (left by a crash) are deleted.

Single-process only (orbax's multi-host coordination is not used): with several JAX processes the cache is skipped.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
from flax import nnx

from models.loader import INDEX_FILE, resolve_dtype
from models.smollm2 import default_cache_dir

logger = logging.getLogger(__name__)

FORMAT_VERSION = 3  # 2: FP8 projections stored [out, in]; 3: block-FP8 experts kept in float8
KEY_FILE = "key.json"
STATE_DIR = "state"
_STAGING_MARK = ".staging-"
_STALE_HIDDEN_SECONDS = 24 * 3600


def default_weight_cache_dir() -> Path:
    """``<default_cache_dir()>/weights`` (``$PAGED_JAX_CACHE`` or ``~/.cache/paged_jax``)."""
    return default_cache_dir() / "weights"


def checkpoint_fingerprint(path: str | os.PathLike) -> dict[str, Any]:
    """``{"path": resolved absolute dir, "files": {name: {"size", "mtime_ns"}}}`` of the files the conversion reads
    (``config.json``, ``*.safetensors``, the safetensors index): any rewrite of them changes the fingerprint."""
    model_dir = Path(path).resolve()
    files = {}
    for file in sorted(model_dir.iterdir()):
        if file.is_file() and (file.suffix == ".safetensors" or file.name in ("config.json", INDEX_FILE)):
            stat = file.stat()
            files[file.name] = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    return {"path": str(model_dir), "files": files}


def cache_key(checkpoint_path: str | os.PathLike, *, dtype: Any, layout: dict[str, Any]) -> dict[str, Any]:
    """The cache key of ``checkpoint_path`` converted to ``dtype`` (any spelling ``resolve_dtype`` accepts) in
    ``layout`` (a JSON-serializable description of everything else the converted parameters depend on, e.g.
    ``{"kind": "fused"}`` or the mesh shape and head layout of a tensor-parallel model)."""
    return {"format_version": FORMAT_VERSION, "checkpoint": checkpoint_fingerprint(checkpoint_path),
            "dtype": resolve_dtype(dtype).name, "layout": layout}


def entry_dir(key: dict[str, Any], cache_dir: str | os.PathLike | None = None) -> Path:
    """Directory of the cache entry of ``key``: ``<cache_dir>/<checkpoint dir name>-<sha256 of the key, 16 hex>``
    (``cache_dir`` defaults to ``default_weight_cache_dir()``)."""
    root = Path(cache_dir) if cache_dir is not None else default_weight_cache_dir()
    digest = hashlib.sha256(_canonical_json(key).encode()).hexdigest()[:16]
    return root / f"{Path(key['checkpoint']['path']).name}-{digest}"


def load_or_convert(key: dict[str, Any] | None, build: Callable[[], nnx.Module],
                    abstract_model: Callable[[], nnx.Module], *,
                    shardings: Callable[[nnx.State], nnx.State] | None = None,
                    cache_dir: str | os.PathLike | None = None) -> nnx.Module:
    """The model ``build()`` returns, restored from the cache when an entry for ``key`` exists.

    Args:
      key: from ``cache_key``; None builds without caching (e.g. random weights, or the cache turned off).
      build: converts the checkpoint (reads safetensors); its model is saved under ``key`` on a miss.
      abstract_model: the same model with shapes only (``nnx.eval_shape``), the restore target: its graphdef and
        parameter shapes/dtypes must be those of ``build()``'s model.
      shardings: maps ``abstract_model()``'s state to a state of the same structure whose leaves are each parameter's
        ``jax.sharding.Sharding`` (e.g. ``ShardingPlan.state_shardings``); None places every leaf on
        ``jax.devices()[0]``, as ``models.loader.load_model`` does.
      cache_dir: the cache root; default ``default_weight_cache_dir()``.
    Returns:
      the model, with every parameter in its target sharding.
    """
    if key is None:
        return build()
    if jax.process_count() > 1:
        logger.info("weights cache skipped: %d JAX processes (single-process only)", jax.process_count())
        return build()
    entry = entry_dir(key, cache_dir)
    if _holds_key(entry, key):
        start = time.perf_counter()
        try:
            model = _restore(entry / STATE_DIR, abstract_model, shardings)
        except Exception as exc:  # a damaged entry costs a conversion, never a failed start
            logger.warning("weights cache entry %s cannot be restored (%s: %s); converting again", entry,
                           type(exc).__name__, exc)
            _discard(entry)
        else:
            logger.info("weights cache hit: restored from %s in %.2f s", entry, time.perf_counter() - start)
            return model
    start = time.perf_counter()
    model = build()
    converted = time.perf_counter()
    try:
        _save(entry, key, model)
    except Exception as exc:  # e.g. a full or read-only disk: serving goes on uncached
        logger.warning("weights converted in %.2f s but not cached to %s (%s: %s)", converted - start, entry,
                       type(exc).__name__, exc)
        return model
    logger.info("weights converted in %.2f s and cached to %s in %.2f s", converted - start, entry,
                time.perf_counter() - converted)
    prune(entry.parent)
    return model


def prune(cache_dir: str | os.PathLike | None = None) -> list[Path]:
    """Delete the entries that can never be hit again (checkpoint deleted or changed, older ``FORMAT_VERSION``) and
    hidden (staging or discarded) directories older than a day; returns the deleted paths. Other directories without
    a readable ``key.json`` are left alone."""
    root = Path(cache_dir) if cache_dir is not None else default_weight_cache_dir()
    removed = []
    for path in sorted(root.iterdir()) if root.is_dir() else ():
        if path.name.startswith("."):  # staging or discarded: ours, and only garbage once old
            try:
                stale = time.time() - path.stat().st_mtime > _STALE_HIDDEN_SECONDS
            except FileNotFoundError:  # committed or discarded meanwhile
                continue
            if stale:
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
            continue
        try:
            key = json.loads((path / KEY_FILE).read_text())
        except (OSError, ValueError):
            continue
        if not _still_valid(key):
            _discard(path)
            removed.append(path)
    return removed


def _still_valid(key: dict[str, Any]) -> bool:
    try:
        checkpoint = key["checkpoint"]
        return (key.get("format_version") == FORMAT_VERSION
                and checkpoint_fingerprint(checkpoint["path"]) == checkpoint)
    except (OSError, KeyError, TypeError):
        return False


def _canonical_json(key: dict[str, Any]) -> str:
    return json.dumps(key, sort_keys=True, separators=(",", ":"))


def _holds_key(entry: Path, key: dict[str, Any]) -> bool:
    """Whether ``entry`` is a committed entry for exactly ``key`` (guards against a hash-prefix collision)."""
    try:
        return json.loads((entry / KEY_FILE).read_text()) == json.loads(_canonical_json(key))
    except (OSError, ValueError):
        return False


def _restore(state_dir: Path, abstract_model: Callable[[], nnx.Module],
             shardings: Callable[[nnx.State], nnx.State] | None) -> nnx.Module:
    graphdef, abstract_state = nnx.split(abstract_model())
    specs = nnx.to_pure_dict(abstract_state)
    if shardings is None:
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        leaf_shardings = jax.tree.map(lambda _: device, specs)
    else:
        leaf_shardings = nnx.to_pure_dict(shardings(abstract_state))
    target = jax.tree.map(lambda spec, sharding: jax.ShapeDtypeStruct(spec.shape, spec.dtype, sharding=sharding),
                          specs, leaf_shardings)
    restored = restore_pytree(state_dir, target)
    nnx.replace_by_pure_dict(abstract_state, restored)
    return nnx.merge(graphdef, abstract_state)


def restore_pytree(state_dir: Path, target: Any) -> Any:
    """Restore an orbax pytree checkpoint into ``target``'s structure, each leaf straight into its
    ``ShapeDtypeStruct``'s sharding. ValueError when a stored leaf's shape or dtype differs from the target's."""
    import orbax.checkpoint as ocp  # imported here: only cached loads pay its import time

    restore_args = jax.tree.map(
        lambda spec: ocp.ArrayRestoreArgs(sharding=spec.sharding, global_shape=spec.shape, dtype=spec.dtype), target)
    with _checkpointer(ocp) as checkpointer:
        restored = checkpointer.restore(Path(state_dir).absolute(),
                                        args=ocp.args.PyTreeRestore(item=target, restore_args=restore_args))
    for spec, value in zip(jax.tree.leaves(target), jax.tree.leaves(restored)):
        if value.shape != spec.shape or value.dtype != spec.dtype:
            raise ValueError(f"stored leaf {value.shape} {value.dtype} does not match the target {spec.shape} "
                             f"{spec.dtype}")
    return restored


def _checkpointer(ocp):
    """A synchronous orbax checkpointer, zarr3 in OCDBT files, without compression: weights barely compress, and
    zstd would cost CPU time on every save and restore."""
    return ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_zarr3=True, use_compression=False))


def _save(entry: Path, key: dict[str, Any], model: nnx.Module) -> None:
    """Write ``model``'s parameters and ``key`` into a staging directory, then commit it to ``entry`` by rename."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{entry.name}{_STAGING_MARK}", dir=entry.parent))
    try:
        import orbax.checkpoint as ocp

        with _checkpointer(ocp) as checkpointer:
            checkpointer.save(staging.absolute() / STATE_DIR,
                              args=ocp.args.PyTreeSave(nnx.to_pure_dict(nnx.state(model))))
        (staging / KEY_FILE).write_text(json.dumps(key, indent=1, sort_keys=True) + "\n")
        os.chmod(staging, 0o755)  # mkdtemp's 0700 would hide the entry from other users of a shared cache
        try:
            os.rename(staging, entry)
        except OSError:
            if not _holds_key(entry, key):
                raise
            # Another process committed the same entry first: keep theirs.
            shutil.rmtree(staging, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _discard(entry: Path) -> None:
    """Remove ``entry``: first renamed aside (atomic, so no reader ever sees it half-deleted), then deleted."""
    doomed = entry.with_name(f".{entry.name}.discarded-{uuid.uuid4().hex[:8]}")
    try:
        os.rename(entry, doomed)
    except FileNotFoundError:  # already discarded by another process
        return
    shutil.rmtree(doomed, ignore_errors=True)
