"""The model runner's compiled step executables, called by key and kept on disk between starts.

JAX's persistent compilation cache is keyed by the lowered program, so a warm start still traces and lowers every
executable (Python, one at a time under the GIL) just to look it up; for the step executables of a 256-sequence,
2048-token engine that is most of a warm start. Here each ``lower(...).compile()`` result is serialized
(``jax.experimental.serialize_executable``) next to JAX's cache, keyed by a fingerprint of everything the traced
program depends on, and a later start deserializes it without tracing at all:

* ``AheadOfTimeFunction`` wraps one of the runner's ``jax.jit`` functions. The warm-up (``paged_jax.worker.warm_up``) puts
  every executable it compiles or loads into its table, keyed by the static arguments and the shapes of the
  arguments whose shape varies; a call with a key in the table runs that executable (``jax.stages.Compiled``: the
  same C++ dispatch path, donation and shardings as ``jax.jit``), any other call goes to the jitted function, whose
  compiles ``num_compiles`` still counts, so a compile after warm-up shows in ``num_compiles_since_warmup``.
* ``ExecutableCache``: one file per executable under ``<jax_compilation_cache_dir>/paged_jax_executables/<runner
  fingerprint>/``. The fingerprint (``runner_fingerprint``) covers the source of ``paged_jax`` and ``models`` (every
  file), the versions of jax / jaxlib / flax / numpy / ml_dtypes and of the GPU plugin packages, the devices
  (platform, kind, id, platform version), JAX's configuration and ``XLA_*`` / ``JAX_*`` / ``LIBTPU*`` / ``TPU_*`` /
  ``PAGED_JAX_MOE_*`` / ``PAGED_JAX_BATCH_INVARIANT_*`` / ``VLLM_BATCH_INVARIANT`` environment variables, the MoE
  decode forms registered (``models.moe.decode_forms``), the model's modules and their static attributes, the
  parameter tree, and the runner's configuration; each file's name adds the function, its static arguments and its
  abstract inputs (shapes, dtypes, shardings). A loaded executable whose input shapes, dtypes or shardings differ from
  those asked for, or an unreadable file, is ignored (compiled instead). Only fresh compiles are saved: an executable
  JAX itself loaded from its persistent cache is not (the CPU client re-serializes such an executable without its
  code: it would fail when run), so after a change that leaves the programs as they were (a new fingerprint, JAX's
  cache still hit) starts trace and lower as before until JAX's entries go. Off when JAX's compilation cache is off
  (``compilation_cache_dir=""``) and in multi-process jobs; the newest ``MAX_FINGERPRINTS`` fingerprint directories
  are kept.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import logging
import os
import pickle
import re
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import msgspec
import numpy as np

from models import moe

logger = logging.getLogger(__name__)

CACHE_SUBDIR = "paged_jax_executables"
# Fingerprint directories kept (newest used first); each holds one engine configuration's executables.
MAX_FINGERPRINTS = 8
# Environment variables that change what a step traces or compiles (the engine's own: its MoE kernels and launches,
# batch-invariant matmuls); others of the engine's (an API key, log intervals, paths) do not.
_ENV_PREFIXES = ("XLA_", "JAX_", "LIBTPU", "TPU_", "PAGED_JAX_MOE_", "PAGED_JAX_BATCH_INVARIANT_",
                 "VLLM_BATCH_INVARIANT")
# JAX options that only say where / whether JAX caches compiles: they do not change a compiled program.
_IGNORED_JAX_OPTIONS = re.compile(r"compilation_cache|persistent_cache|log_compiles|explain_cache_misses")
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
_PACKAGES = ("paged_jax", "models")  # the code every step executable is traced from
_PERSISTENT_CACHE_HIT = "/jax/compilation_cache/cache_hits"
# Runner attributes that change while it runs (the fingerprint describes its configuration only).
_RUN_TIME_STATE = frozenset({"warm_up_timings", "step_channel", "ready", "background"})


def own_function(fn):
    """A new function object calling ``fn``: jit's executable cache is per function object and shared by every
    ``jax.jit`` of it, so a runner jitting its own wrapper counts only its own compiles (``num_compiles``)."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        return fn(*args, **kwargs)

    return call


class AheadOfTimeFunction:
    """A ``jax.jit`` function plus the executables compiled (or loaded) for it ahead of time.

    Args:
      name: names its cache files (e.g. "forward").
      jitted: the ``jax.jit`` function; called for any key not in the table.
      shape_args: positions of the arguments whose shape tells executables apart (the others have one shape per
        runner); with the static keyword arguments they make the key.
    """

    def __init__(self, name: str, jitted, shape_args: Sequence[int] = ()):
        self.name = name
        self.jitted = jitted
        self.shape_args = tuple(shape_args)
        self.executables: dict[tuple, jax.stages.Compiled] = {}
        # Set while executables still land in the background (paged_jax.worker.background_compile): a call whose
        # key is missing waits for them instead of compiling on the step path.
        self.landing: Landing | None = None

    def key(self, args: Sequence, static: dict) -> tuple:
        """The table key of a call (``args`` arrays or ``jax.ShapeDtypeStruct``s, ``static`` its keywords)."""
        return tuple(args[i].shape for i in self.shape_args), tuple(sorted(static.items()))

    def __call__(self, *args, **static):
        executable = self.executables.get(self.key(args, static))
        if executable is None:
            return self._miss(args, static)
        return executable(*args)

    def _miss(self, args, static):
        """A call outside the table: the executable once the background compiles have put it there, else (none
        pending, or they ended without it) jit's, which compiles and counts in ``num_compiles``."""
        landing = self.landing
        if landing is not None:
            executable = landing.wait_for(self, self.key(args, static))
            if executable is not None:
                return executable(*args)
        return self.jitted(*args, **static)

    def put(self, key: tuple, compiled) -> None:
        """Add ``compiled`` to the table (a dict store: atomic for the step thread reading it) and wake the calls
        waiting for it."""
        self.executables[key] = compiled
        if self.landing is not None:
            self.landing.notify()

    def lower(self, *args, **static):
        return self.jitted.lower(*args, **static)

    def trace(self, *args, **static):
        return self.jitted.trace(*args, **static)

    def _cache_size(self) -> int:
        """Executables this function holds: its table's and those jit compiled on calls outside the table."""
        return len(self.executables) + self.jitted._cache_size()

    def jit_compiles(self) -> int:
        """Executables jit compiled on calls outside the table (a warmed-up runner's step path compiles nothing)."""
        return self.jitted._cache_size()


class Landing:
    """Executables landing in ``AheadOfTimeFunction`` tables from a background thread: a call whose key is missing
    waits (``wait_for``) until its executable lands or the background ends (``finish``)."""

    def __init__(self):
        self._changed = threading.Condition()
        self.active = True

    def notify(self) -> None:
        with self._changed:
            self._changed.notify_all()

    def finish(self) -> None:
        """No more executables will land: wake every waiting call (they fall back to jit)."""
        with self._changed:
            self.active = False
            self._changed.notify_all()

    def wait_for(self, function: AheadOfTimeFunction, key: tuple):
        """``function``'s executable for ``key`` once it has landed, or None once nothing more lands."""
        executable = function.executables.get(key)
        if executable is not None or not self.active:
            return executable
        logger.info("a step waits for %s%s, still compiling in the background", function.name, key)
        with self._changed:
            self._changed.wait_for(lambda: key in function.executables or not self.active)
        return function.executables.get(key)


class ExecutableCache:
    """Serialized executables of one runner fingerprint in ``directory`` (``for_runner`` builds it)."""

    def __init__(self, directory: Path, fingerprint: str):
        self.directory = Path(directory)
        self.fingerprint = fingerprint
        self.hits = self.misses = 0

    @classmethod
    def for_runner(cls, runner) -> "ExecutableCache | None":
        """The cache of ``runner``'s executables, or None when JAX's compilation cache is off or the job spans
        several processes (each would load executables compiled for its own devices only)."""
        root = jax.config.jax_compilation_cache_dir
        if not root or jax.process_count() > 1:
            return None
        try:
            fingerprint = runner_fingerprint(runner)
        except Exception as exc:  # e.g. a JAX without one of the APIs it reads: compile as without the cache
            logger.warning("executable cache off: no fingerprint (%s: %s)", type(exc).__name__, exc)
            return None
        if jax.default_backend() == "gpu":  # here, before warm-up loads executables on several threads
            _load_mosaic_gpu_runtime()
        directory = Path(root) / CACHE_SUBDIR / fingerprint
        try:
            directory.mkdir(parents=True, exist_ok=True)
            os.utime(directory)  # the newest used: kept by _prune
            _prune(directory.parent, keep=MAX_FINGERPRINTS)
        except OSError as exc:
            logger.warning("executable cache off: %s (%s)", directory, exc)
            return None
        return cls(directory, fingerprint)

    def _path(self, name: str, args: Sequence, static: dict) -> Path:
        text = repr((name, sorted(static.items()), [_abstract_repr(x) for x in jax.tree.leaves(args)]))
        return self.directory / f"{name}-{hashlib.sha256(text.encode()).hexdigest()[:32]}.bin"

    def load(self, name: str, args: Sequence, static: dict):
        """The executable saved for ``name`` on abstract inputs ``args`` with ``static`` keywords, or None."""
        path = self._path(name, args, static)
        if not path.is_file():
            logger.debug("executable cache: no %s", path.name)
            self.misses += 1
            return None
        try:
            from jax.experimental.serialize_executable import deserialize_and_load

            payload, in_tree, out_tree = pickle.loads(path.read_bytes())
            compiled = deserialize_and_load(payload, in_tree, out_tree, execution_devices=_devices_of(args))
            _check_inputs(compiled, args)
        except Exception as exc:  # a stale, truncated or foreign file: compile instead
            logger.warning("executable cache: ignoring %s (%s: %s)", path.name, type(exc).__name__, exc)
            self.misses += 1
            return None
        self.hits += 1
        return compiled

    def save(self, name: str, args: Sequence, static: dict, compiled) -> None:
        """Write ``compiled`` (atomically: a reader sees the whole file or none); an executable that cannot be
        serialized is left out with a log line."""
        from jax.experimental.serialize_executable import serialize

        path = self._path(name, args, static)
        try:
            data = pickle.dumps(serialize(compiled), protocol=pickle.HIGHEST_PROTOCOL)
            with tempfile.NamedTemporaryFile(dir=self.directory, prefix=f".{path.name}.", delete=False) as f:
                f.write(data)
            os.replace(f.name, path)
        except Exception as exc:  # e.g. an executable with constants it cannot serialize, a full disk
            logger.warning("executable cache: %s not saved (%s: %s)", path.name, type(exc).__name__, exc)


_MOSAIC_IMPORT_FAILED: list = []


def _load_mosaic_gpu_runtime() -> None:
    """Make the Mosaic GPU runtime findable before an executable holding a Mosaic GPU kernel (the hybrid prefill
    attention) is loaded: importing jax's Mosaic GPU module tells the custom call where the runtime library is (an
    environment variable it sets), which a fresh process that only deserializes executables would otherwise never do
    (its kernel fails to link: "Symbols not found: mosaic_gpu_launch_kernel"). ``for_runner`` calls it on a GPU,
    before warm-up's loading threads start (setting the variable while they read the environment would race)."""
    try:
        import jax.experimental.mosaic.gpu  # noqa: F401
    except ImportError:  # a jax without Mosaic GPU cannot have written such an executable
        pass
    except Exception as exc:  # a broken runtime: its executables will miss and compile; say why, once
        if not _MOSAIC_IMPORT_FAILED:
            _MOSAIC_IMPORT_FAILED.append(exc)
            logger.warning("Mosaic GPU runtime not importable (%s: %s): executables holding Mosaic GPU kernels "
                           "will be compiled, not loaded", type(exc).__name__, exc)


def _abstract_repr(x) -> str:
    return f"{tuple(x.shape)}:{np.dtype(x.dtype).name}:{_ADDRESS.sub('', repr(x.sharding))}"


def _devices_of(args: Sequence) -> list:
    """The devices the executable runs on: those of its inputs' shardings, in device-id order."""
    devices = {d for x in jax.tree.leaves(args) for d in x.sharding.device_set}
    return sorted(devices, key=lambda d: d.id)


def _check_inputs(compiled, args: Sequence) -> None:
    """Raise ValueError unless ``compiled`` takes exactly ``args``' shapes and dtypes, and the shardings of those it
    uses (``input_shardings`` leaves out the inputs XLA dropped as unused)."""
    infos = jax.tree.leaves(compiled.args_info)
    flat = jax.tree.leaves(args)
    if len(infos) != len(flat):
        raise ValueError(f"{len(infos)} inputs, expected {len(flat)}")
    for info, x in zip(infos, flat):
        if tuple(info.shape) != tuple(x.shape) or np.dtype(info.dtype) != np.dtype(x.dtype):
            raise ValueError(f"input {info.shape} {info.dtype}, expected {x.shape} {x.dtype}")
    shardings = jax.tree.leaves(compiled.input_shardings[0])
    if len(shardings) != len(flat):  # some inputs dropped: compare those kept (the file name has all shardings)
        kept = getattr(compiled._executable, "_kept_var_idx", None) or ()
        flat = [x for i, x in enumerate(flat) if i in kept]
    if len(shardings) != len(flat):
        raise ValueError(f"{len(shardings)} input shardings, expected {len(flat)}")
    for sharding, x in zip(shardings, flat):
        if not sharding.is_equivalent_to(x.sharding, len(x.shape)):
            raise ValueError(f"input sharding {sharding}, expected {x.sharding}")


def _prune(root: Path, keep: int) -> None:
    """Remove all but the ``keep`` most recently used fingerprint directories under ``root``."""
    dirs = sorted((d for d in root.iterdir() if d.is_dir()), key=lambda d: d.stat().st_mtime, reverse=True)
    for stale in dirs[keep:]:
        shutil.rmtree(stale, ignore_errors=True)


# ----------------------------------------------------------------------------------------------------------------
# The fingerprint: everything a traced step program depends on besides its abstract inputs
# ----------------------------------------------------------------------------------------------------------------

@functools.cache
def _source_digest() -> str:
    """sha256 over every file of the packages the step programs are traced from (code, kernels, tuning tables)."""
    digest = hashlib.sha256()
    for package in _PACKAGES:
        root = Path(sys.modules[package].__file__).parent
        for path in sorted(root.rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts:
                digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def _versions() -> dict[str, str]:
    import flax
    import jaxlib
    import ml_dtypes

    versions = {"python": sys.version, "jax": jax.__version__, "jaxlib": jaxlib.__version__,
                "flax": flax.__version__, "numpy": np.__version__, "ml_dtypes": ml_dtypes.__version__}
    # The GPU backend ships as plugin packages (jax-cuda13-plugin / -pjrt, ...) versioned apart from jaxlib (the
    # CUDA runtime it reports is keyed with the devices).
    from importlib import metadata

    for dist in metadata.distributions():
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if name.startswith(("jax-cuda", "jax-rocm")):
            versions[name] = dist.version
    return versions


def describe(value: Any) -> str | None:
    """A deterministic text for a configuration value (no memory addresses), or None for values that are not
    configuration (arrays, executors, functions, other objects)."""
    if value is None or isinstance(value, (bool, int, float, str, np.dtype)):
        return repr(value)
    if isinstance(value, (tuple, list, set, frozenset)):
        items = [describe(v) for v in value]
        items = sorted(items) if isinstance(value, (set, frozenset)) else items
        return None if None in items else f"{type(value).__name__}({', '.join(items)})"
    if isinstance(value, dict):
        items = [(describe(k), describe(v)) for k, v in value.items()]
        return None if any(None in kv for kv in items) else f"dict({sorted(items)})"
    if isinstance(value, jax.Device):
        return f"{value.platform}:{value.device_kind}:{value.id}"
    if isinstance(value, (jax.sharding.Sharding, msgspec.Struct)) or (
            dataclasses.is_dataclass(value) and not isinstance(value, type)):
        return _ADDRESS.sub("", repr(value))
    if hasattr(value, "dtype") and not hasattr(value, "shape"):  # a jnp scalar type
        return repr(np.dtype(value))
    return None


def describe_attributes(obj: Any) -> dict[str, str]:
    """``describe`` of each public attribute of ``obj`` that is configuration (not run-time state)."""
    out = {}
    for name, value in sorted(vars(obj).items()):
        text = None if name.startswith("_") or name in _RUN_TIME_STATE else describe(value)
        if text is not None:
            out[name] = text
    return out


def _model_description(runner) -> list:
    """Each module of the model (path, type, its static attributes), and the parameter tree."""
    from flax import nnx

    model = nnx.merge(runner._graphdef, jax.tree.unflatten(runner._state_treedef, runner._param_leaves))
    modules = []
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Module):
            attrs = {k: describe(v) for k, v in sorted(vars(node).items())
                     if not isinstance(v, (nnx.Module, nnx.Variable)) and not k.startswith("_pytree")}
            modules.append((tuple(map(str, path)), type(node).__qualname__,
                            sorted((k, v) for k, v in attrs.items() if v is not None)))
    return [modules, _ADDRESS.sub("", repr(runner._state_treedef))]


def runner_fingerprint(runner) -> str:
    """sha256 hex digest of what ``runner``'s step programs depend on besides their abstract inputs (module
    docstring)."""
    devices = jax.devices()
    parts = {
        "source": _source_digest(),
        "versions": _versions(),
        "devices": [(describe(d), getattr(d.client, "platform_version", "")) for d in devices],
        "processes": (jax.process_index(), jax.process_count()),
        "jax_config": sorted((k, _ADDRESS.sub("", repr(v))) for k, v in jax.config.values.items()
                             if not _IGNORED_JAX_OPTIONS.search(k)),
        "env": sorted((k, v) for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES)),
        "model": _model_description(runner),
        "moe_forms": moe.decode_forms(),
        "runner": (type(runner).__qualname__, describe_attributes(runner)),
        "forward": (type(runner.forward_strategy).__qualname__, describe_attributes(runner.forward_strategy)),
        "lora": runner.lora_slots and describe_attributes(runner.lora_slots),
    }
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:40]


class _PersistentCacheHits(threading.local):
    """JAX's persistent-cache hits of the calling thread (its monitoring event fires in the compiling thread)."""

    count = 0


_hits = _PersistentCacheHits()


@functools.cache
def _count_persistent_cache_hits() -> None:
    def listener(event: str, **_) -> None:
        if event == _PERSISTENT_CACHE_HIT:
            _hits.count += 1

    jax.monitoring.register_event_listener(listener)


def load_or_compile(cache: ExecutableCache | None, function: AheadOfTimeFunction, args: Sequence,
                    static: dict | None = None, seconds: dict | None = None,
                    lowering_turn=contextlib.nullcontext(), compile_slots=None):
    """``function``'s executable for abstract inputs ``args`` and ``static`` keywords: loaded from ``cache``, else
    lowered and compiled (and saved unless JAX loaded it from its persistent cache); put into ``function``'s table
    and returned. ``seconds`` (optional): its ``"lower"`` entry grows by the time spent tracing and lowering
    (Python, under the GIL: what concurrent compiles cannot overlap). ``lowering_turn`` (optional): a context
    manager (reusable) entered around tracing and lowering only (e.g. ``paged_jax.worker.warm_up``'s turn of one thread at
    a time); the time waiting for it is not counted in ``seconds``. ``compile_slots`` (optional): runs XLA's compile
    (``compile_slots.run(compile)``, e.g. ``paged_jax.worker.compile_queue.CompileSlots``, bounding the compiles whose
    autotuning holds device memory at once)."""
    static = static or {}
    compiled = cache.load(function.name, args, static) if cache is not None else None
    if compiled is None:
        _count_persistent_cache_hits()
        hits_before = _hits.count
        with lowering_turn:
            start = time.perf_counter()
            lowered = function.lower(*args, **static)
            if seconds is not None:
                seconds["lower"] = seconds.get("lower", 0.0) + time.perf_counter() - start
        compiled = compile_slots.run(lowered.compile) if compile_slots is not None else lowered.compile()
        if cache is not None and _hits.count == hits_before:
            cache.save(function.name, args, static, compiled)
    function.put(function.key(args, static), compiled)
    return compiled

