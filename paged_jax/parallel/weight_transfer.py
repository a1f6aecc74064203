"""Weights from a trainer in another process of the same JAX job (vLLM's weight transfer, backend ``"jax"``).

The trainer and the engine are two processes of one ``jax.distributed`` job (the engine started with
``weight_transfer_config={"backend": "jax"}``, so it runs on its own devices and takes no part in multi-host
stepping). The trainer calls ``send_weights(params, engine_process=...)`` while the engine runs
``update_weights_from_distributed(names, dtype_names, shapes)`` (vLLM's update-info fields), after
``init_weight_transfer_engine({"trainer_process": i})``:

1. The trainer publishes its parameters' names, dtypes and shapes under ``paged_jax/weight_transfer/<n>/meta`` in the
   coordinator's key-value store (``n`` counts the transfers); the engine compares them with its update info and
   checks them against its model (``WeightUpdater.check``), then answers ``ok`` or the error under ``.../verdict``:
   a refused update raises on both sides before any collective, so neither waits forever in one.
2. The arrays cross in collectives over a two-device mesh (the trainer process's first local device, the engine
   process's): per group of parameters (``GROUP_BYTES`` at most, in the order given) both processes build one global
   ``[2, *shape]`` array from their local ``[1, *shape]`` rows (the trainer's values, the engine's zeros) and run the
   same jitted sum over the process axis, replicated out, so each process holds the values on its own device
   (``x + 0`` is exact). Device to device; nothing goes through the host.
3. The engine hands the received ``{name: array}`` to its usual update (``WeightUpdater.update``: transforms
   re-applied, prefix cache reset).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from paged_jax.parallel.multihost import wait_for_key

BACKENDS = ("jax",)
_KEY_PREFIX = "paged_jax/weight_transfer/"
# Most bytes of parameters crossing in one collective program (bounds the engine's extra memory during a transfer).
GROUP_BYTES = 1 << 30
_POLL_MS = 5000


def _client():
    from jax._src.distributed import global_state  # jax.distributed's client (no public accessor)

    if global_state.client is None or jax.process_count() < 2:
        raise ValueError("weight transfer: this process is not in a multi-process jax.distributed job (initialize "
                         "it in the trainer and in the engine's process first)")
    return global_state.client


def _mesh(trainer_process: int, engine_process: int) -> Mesh:
    """The two-device mesh ``("p",)``: [trainer's first local device, engine's first local device]."""
    devices = [next(d for d in jax.devices() if d.process_index == p) for p in (trainer_process, engine_process)]
    return Mesh(np.array(devices), ("p",))


def _groups(shapes: Sequence[tuple], dtypes: Sequence[str]) -> list[list[int]]:
    """Indices of the parameters in consecutive groups of at most ``GROUP_BYTES`` (one parameter at least)."""
    groups: list[list[int]] = [[]]
    size = 0
    for index, (shape, dtype) in enumerate(zip(shapes, dtypes)):
        nbytes = int(np.prod(shape, dtype=np.int64)) * jnp.dtype(dtype).itemsize
        if groups[-1] and size + nbytes > GROUP_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(index)
        size += nbytes
    return groups


def _cross(mesh: Mesh, local_rows: list, shapes: list[tuple]) -> list:
    """One collective: every process passes its ``[1, *shape]`` rows (on its own mesh device); returns the sums over
    the process axis, this process's replica (on its device)."""
    row_sharding = NamedSharding(mesh, P("p"))
    global_arrays = [jax.make_array_from_single_device_arrays((2, *shape), row_sharding, [row])
                     for row, shape in zip(local_rows, shapes)]
    summed = jax.jit(lambda xs: [jnp.sum(x, axis=0, dtype=x.dtype) for x in xs],
                     out_shardings=NamedSharding(mesh, P()))(global_arrays)
    return [x.addressable_data(0) for x in summed]


def _transfer(mesh: Mesh, values: list | None, shapes: list[tuple], dtypes: list[str], device) -> list:
    """The group-by-group collectives of one transfer: ``values`` (the trainer's arrays) or None (the engine's
    zeros); the received arrays on ``device``."""
    received = []
    for group in _groups(shapes, dtypes):
        if values is None:
            rows = [jnp.zeros((1, *shapes[i]), dtypes[i], device=device) for i in group]
        else:
            rows = [jax.device_put(jnp.asarray(values[i]).reshape(1, *shapes[i]), device) for i in group]
        received += _cross(mesh, rows, [shapes[i] for i in group])
    return received


class WeightTransferReceiver:
    """The engine's side (see the module docstring): ``trainer_process`` is the trainer's ``jax.process_index()``."""

    def __init__(self, trainer_process: int):
        self._client_handle = _client()
        if not 0 <= trainer_process < jax.process_count() or trainer_process == jax.process_index():
            raise ValueError(f"init_info: trainer_process must be another process of the job (0.."
                             f"{jax.process_count() - 1}, this engine is {jax.process_index()}), got {trainer_process}")
        self._mesh = _mesh(trainer_process, jax.process_index())
        self._device = self._mesh.devices[1]
        self._transfers = 0

    def receive(self, names: list[str], dtype_names: list[str], shapes: list[list[int]], check) -> dict[str, Any]:
        """The trainer's next transfer as ``{name: array}`` on this process's device. ``check(named specs)`` raises
        ValueError for parameters the engine cannot take; it, or metadata other than the trainer's, refuses the
        transfer on both sides (ValueError here)."""
        key = f"{_KEY_PREFIX}{self._transfers}/"
        self._transfers += 1
        sent = json.loads(wait_for_key(self._client_handle, key + "meta", _POLL_MS, "waiting for the trainer"))
        given = {"names": list(names), "dtype_names": list(dtype_names), "shapes": [list(s) for s in shapes]}
        try:
            if sent != given:
                raise ValueError("update_weights_from_distributed: names / dtype_names / shapes differ from what "
                                 f"the trainer sends ({len(sent['names'])} parameters, first "
                                 f"{sent['names'][:1]})")
            check({n: jax.ShapeDtypeStruct(tuple(s), jnp.dtype(d)) for n, d, s in zip(names, dtype_names, shapes)})
        except ValueError as exc:
            self._client_handle.key_value_set_bytes(key + "verdict", f"error: {exc}".encode())
            raise
        self._client_handle.key_value_set_bytes(key + "verdict", b"ok")
        shapes = [tuple(s) for s in shapes]
        return dict(zip(names, _transfer(self._mesh, None, shapes, list(dtype_names), self._device)))


_sent_transfers = 0  # send_weights calls of this process (the engine counts its receives the same way)


def send_weights(params: dict[str, Any], *, engine_process: int) -> None:
    """The trainer's side: send ``params`` (``{name: array}``, the engine's model paths or HF names, in the order
    the engine's ``update_weights_from_distributed`` lists them) to the engine in process ``engine_process``.
    Blocks until the engine has checked them and received them; RuntimeError with the engine's message when it
    refuses them."""
    global _sent_transfers
    client = _client()
    key = f"{_KEY_PREFIX}{_sent_transfers}/"
    _sent_transfers += 1
    info = metadata(params)
    client.key_value_set_bytes(key + "meta", json.dumps(info).encode())
    verdict = wait_for_key(client, key + "verdict", _POLL_MS, "waiting for the engine's answer").decode()
    if verdict != "ok":
        raise RuntimeError(f"the engine refused the weights: {verdict}")
    mesh = _mesh(jax.process_index(), engine_process)
    shapes = [tuple(s) for s in info["shapes"]]
    _transfer(mesh, [params[n] for n in info["names"]], shapes, info["dtype_names"], mesh.devices[0])


def metadata(params: dict[str, Any]) -> dict[str, list]:
    """vLLM's update info of ``params``: ``{"names", "dtype_names", "shapes"}`` (what the engine's
    ``update_weights_from_distributed`` takes)."""
    names = list(params)
    return {"names": names, "dtype_names": [jnp.dtype(params[n].dtype).name for n in names],
            "shapes": [[int(d) for d in params[n].shape] for n in names]}
