"""Multi-host (multi-process) plumbing: start-up, host-local <-> global arrays, host reductions.

Every process runs the same program (SPMD). Host-side state, such as the rollout slots,
the data iterator and the grader, is per host: process ``p`` owns rows
``[p * n, (p + 1) * n)`` of every global batch, with ``n = B / process_count``. Device
computations see one global ``jax.Array``.
- ``host_to_global`` builds it from each host's rows.
- ``global_to_host`` reads this host's rows back.
- ``sum_over_hosts`` / ``max_over_hosts`` / ``gather_rows`` / ``gather_json`` combine what
  hosts computed locally (metrics, eval results, checkpoint metadata).
With one process every function reduces to its single-host meaning, so the trainer has one
code path.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from tppo_jax.parallel.mesh import batch_sharding

log = logging.getLogger(__name__)

ENV_COORDINATOR = "TPPO_COORDINATOR"  # host:port of process 0
ENV_NUM_PROCESSES = "TPPO_NUM_PROCESSES"
ENV_PROCESS_ID = "TPPO_PROCESS_ID"
ENV_DISTRIBUTED = "TPPO_DISTRIBUTED"  # "auto": let JAX discover the cluster (TPU pods)


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, auto: bool = False) -> bool:
    """Starts ``jax.distributed`` from arguments, else from ``TPPO_*`` environment variables.

    ``auto`` (or ``TPPO_DISTRIBUTED=auto``) calls ``jax.distributed.initialize()`` without
    arguments; Cloud TPU pods (and SLURM/Open MPI) describe the cluster to JAX themselves.
    Explicit settings need all three of coordinator, process count and process id. CPU
    collectives use gloo. Returns True when a multi-process runtime was started.
    Must run before anything touches a device.
    """
    env = os.environ
    coordinator = coordinator or env.get(ENV_COORDINATOR) or None
    if num_processes is None and env.get(ENV_NUM_PROCESSES):
        num_processes = _env_int(ENV_NUM_PROCESSES)
    if process_id is None and env.get(ENV_PROCESS_ID):
        process_id = _env_int(ENV_PROCESS_ID)
    auto = auto or env.get(ENV_DISTRIBUTED, "").lower() == "auto"
    given = {"coordinator": coordinator, "num_processes": num_processes,
             "process_id": process_id}
    if not auto and all(v is None for v in given.values()):
        return False
    if not auto:
        missing = [k for k, v in given.items() if v is None]
        if missing:
            raise ValueError(f"distributed: {', '.join(missing)} not set; pass --coordinator, "
                             f"--num-processes and --process-id (or {ENV_COORDINATOR}, "
                             f"{ENV_NUM_PROCESSES}, {ENV_PROCESS_ID}), or --distributed auto")
        if not 0 <= process_id < num_processes:
            raise ValueError(f"distributed: process id {process_id} is not in "
                             f"[0, {num_processes})")
    # Only the CPU backend reads this (on TPU/GPU it is inert): gloo for CPU collectives.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if auto:
        jax.distributed.initialize()
    else:
        jax.distributed.initialize(coordinator, num_processes=num_processes,
                                   process_id=process_id)
    log.info("distributed: process %d of %d, %d local / %d global devices",
             jax.process_index(), jax.process_count(), jax.local_device_count(),
             jax.device_count())
    return True


def _env_int(name: str) -> int:
    try:
        return int(os.environ[name])
    except ValueError:
        raise ValueError(f"{name}={os.environ[name]!r} is not an integer") from None


def is_primary() -> bool:
    """Process 0: the one that writes logs, plots and summaries."""
    return jax.process_index() == 0


def local_count(n_global: int) -> int:
    """This host's share of ``n_global`` rows (``n_global`` must divide evenly)."""
    p = jax.process_count()
    if n_global % p:
        raise ValueError(f"{n_global} rows cannot be split evenly over {p} processes")
    return n_global // p


def check_batch_layout(mesh: Mesh, n_global: int) -> None:
    """Each process must address exactly its own contiguous block of batch rows; otherwise
    per-host data would be silently mixed up (e.g. a tensor axis that spans hosts while
    the batch axes do not)."""
    p = jax.process_count()
    if p == 1:
        return
    sharding = batch_sharding(mesh, 1, (n_global,))
    n = local_count(n_global)
    want = set(range(jax.process_index() * n, (jax.process_index() + 1) * n))
    rows: set[int] = set()
    for idx in sharding.addressable_devices_indices_map((n_global,)).values():
        rows.update(range(*idx[0].indices(n_global)))
    if rows != want:
        raise ValueError(
            f"mesh {dict(mesh.shape)}: process {jax.process_index()} holds batch rows "
            f"{min(rows)}..{max(rows)}, not its own block {min(want)}..{max(want)}; with "
            f"{p} processes the batch axes (mesh.data * mesh.fsdp) must span the hosts "
            f"(keep mesh.tensor within one host)")


def host_to_global(x: np.ndarray, mesh: Mesh) -> jax.Array:
    """One global ``[B, ...]`` array from every host's ``[B / P, ...]`` rows, laid out with
    ``batch_sharding`` (single process: a plain ``device_put``)."""
    x = np.asarray(x)
    shape = (x.shape[0] * jax.process_count(), *x.shape[1:])
    sharding = batch_sharding(mesh, x.ndim, shape)
    if jax.process_count() == 1:
        return jax.device_put(x, sharding)
    return jax.make_array_from_process_local_data(sharding, x, shape)


def global_to_host(x: jax.Array) -> np.ndarray:
    """This host's rows of a global ``[B, ...]`` array (all of it if replicated or scalar),
    read from the shards it addresses: no cross-host transfer. Always a writable copy."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable or x.ndim == 0:
        return np.array(x)
    if x.is_fully_replicated:
        return np.array(x.addressable_shards[0].data)
    n = local_count(x.shape[0])
    lo = jax.process_index() * n
    out = np.empty((n, *x.shape[1:]), x.dtype)
    filled = np.zeros(n, bool)
    for shard in x.addressable_shards:
        rows = range(*shard.index[0].indices(x.shape[0]))
        if rows.start >= lo + n or rows.stop <= lo:
            continue
        a, b = max(rows.start, lo), min(rows.stop, lo + n)
        data = np.asarray(shard.data)
        out[a - lo:b - lo] = data[a - rows.start:b - rows.start]
        filled[a - lo:b - lo] = True
    if not filled.all():
        raise ValueError(f"process {jax.process_index()} does not address all of its rows "
                         f"{lo}..{lo + n - 1} of an array sharded as {x.sharding}")
    return out


def tree_to_host(tree: Any) -> Any:
    return jax.tree.map(global_to_host, tree)


def _allgather(x: np.ndarray) -> np.ndarray:
    """``[P, *x.shape]``: every host's ``x``."""
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(np.asarray(x)))


def _reduce_over_hosts(values: Mapping[str, float], op) -> dict[str, float]:
    if jax.process_count() == 1:
        return {k: float(v) for k, v in values.items()}
    keys = sorted(values)
    every = _allgather(np.array([float(values[k]) for k in keys], np.float64))
    return dict(zip(keys, map(float, op(every, axis=0)), strict=True))


def sum_over_hosts(values: Mapping[str, float]) -> dict[str, float]:
    """Sums each value over hosts (identity with one process)."""
    return _reduce_over_hosts(values, np.sum)


def max_over_hosts(values: Mapping[str, float]) -> dict[str, float]:
    """Maximum of each value over hosts (identity with one process)."""
    return _reduce_over_hosts(values, np.max)


def gather_rows(x: np.ndarray) -> np.ndarray:
    """Concatenates every host's rows (hosts may hold different counts), in process order."""
    return np.concatenate(gather_rows_list(x))


def gather_json(obj: Any) -> list[Any]:
    """Every host's JSON-serialisable ``obj``, in process order."""
    if jax.process_count() == 1:
        return [obj]
    blob = np.frombuffer(json.dumps(obj).encode(), np.uint8)
    parts = gather_rows_list(blob)
    return [json.loads(p.tobytes().decode()) for p in parts]


def gather_rows_list(x: np.ndarray) -> list[np.ndarray]:
    """Like ``gather_rows`` but keeps hosts apart: a list of each host's rows."""
    x = np.asarray(x)
    if jax.process_count() == 1:
        return [x]
    counts = _allgather(np.array([x.shape[0]], np.int64))[:, 0]
    pad = np.zeros((int(counts.max()), *x.shape[1:]), x.dtype)
    pad[:x.shape[0]] = x
    every = _allgather(pad)
    return [every[i, :c] for i, c in enumerate(counts)]


def barrier(name: str) -> None:
    """Blocks until every process gets here (no-op with one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def split_for_host(items: Sequence[Any]) -> list[Any]:
    """This host's share of a list every host holds in full (strided, so shares differ by
    at most one item)."""
    return list(items[jax.process_index()::jax.process_count()])
