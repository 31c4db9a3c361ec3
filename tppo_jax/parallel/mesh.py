"""Device meshes and the logical-axis -> mesh-axis rules.

Every parameter and batch array names its dimensions with *logical* axes
(``batch``, ``embed``, ``mlp``, ...). ``LOGICAL_RULES`` maps each logical axis to
mesh axes (``data``, ``fsdp``, ``tensor``); this table is the one place where the
layout is decided. Meshes use ``AxisType.Auto``: jax 0.10's ``jax.make_mesh``
defaults to explicit axes, under which sharded matmuls raise ``ShardingTypeError``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

MESH_AXES: tuple[str, ...] = ("data", "fsdp", "tensor")

# logical axis -> mesh axes (None = replicated). Batch splits over data and fsdp
# (FSDP is data parallel with sharded params); weights split their large dim
# over fsdp and the head/mlp/vocab dim over tensor.
LOGICAL_RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": ("data", "fsdp"),
    "seq": None,
    "embed": "fsdp",
    "mlp": "tensor",
    "heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "vocab": "tensor",
    "layers": None,
    "norm": None,
    "pages": None,
    "page_slot": None,
}


def make_mesh(
    shape: Mapping[str, int] | None = None,
    devices: Sequence[jax.Device] | None = None,
) -> Mesh:
    """Builds a ``(data, fsdp, tensor)`` mesh with Auto axis types.

    Args:
      shape: sizes per axis, e.g. ``{"fsdp": 4, "tensor": 2}``; missing axes are 1;
        one axis may be ``-1`` to take the remaining devices. ``None`` puts every
        device on ``data``.
      devices: devices to use (default: all).
    """
    devices = list(devices if devices is not None else jax.devices())
    shape = dict(shape or {"data": -1})
    unknown = set(shape) - set(MESH_AXES)
    if unknown:
        raise ValueError(f"mesh: unknown axis {sorted(unknown)}; valid axes are {MESH_AXES}")
    sizes = {a: int(shape.get(a, 1)) for a in MESH_AXES}
    free = [a for a, s in sizes.items() if s == -1]
    if len(free) > 1:
        raise ValueError(f"mesh: only one axis may be -1, got {free}")
    known = math.prod(s for s in sizes.values() if s != -1)
    if free:
        if len(devices) % known:
            raise ValueError(f"mesh: {len(devices)} devices not divisible by {known}")
        sizes[free[0]] = len(devices) // known
    total = math.prod(sizes.values())
    if total != len(devices):
        raise ValueError(
            f"mesh: data*fsdp*tensor = {total} ({sizes}) but {len(devices)} devices are available"
        )
    arr = np.asarray(devices, dtype=object).reshape([sizes[a] for a in MESH_AXES])
    return Mesh(arr, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def logical_to_spec(
    logical_axes: Sequence[str | None],
    rules: Mapping[str, str | tuple[str, ...] | None] = LOGICAL_RULES,
) -> PartitionSpec:
    """Maps logical axis names to a PartitionSpec; a mesh axis is used at most once."""
    used: set[str] = set()
    out: list[str | tuple[str, ...] | None] = []
    for name in logical_axes:
        if name is None:
            out.append(None)
            continue
        if name not in rules:
            raise KeyError(f"no sharding rule for logical axis {name!r}; known: {sorted(rules)}")
        target = rules[name]
        axes = (target,) if isinstance(target, str) else tuple(target or ())
        axes = tuple(a for a in axes if a not in used)
        used.update(axes)
        out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return PartitionSpec(*out)


def _fits(shape: Sequence[int], spec: PartitionSpec, mesh: Mesh) -> PartitionSpec:
    """Drops mesh axes from dims they don't divide (tiny test models, odd vocab sizes)."""
    fixed: list[str | tuple[str, ...] | None] = []
    for dim, entry in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec)), strict=False):
        if entry is None:
            fixed.append(None)
            continue
        axes = (entry,) if isinstance(entry, str) else tuple(entry)
        kept: list[str] = []
        size = 1
        for a in axes:
            if dim % (size * mesh.shape[a]) == 0:
                kept.append(a)
                size *= mesh.shape[a]
        fixed.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
    return PartitionSpec(*fixed)


def named_sharding(
    mesh: Mesh,
    logical_axes: Sequence[str | None],
    shape: Sequence[int] | None = None,
    rules: Mapping[str, str | tuple[str, ...] | None] = LOGICAL_RULES,
) -> NamedSharding:
    """NamedSharding for an array with the given logical axes (and shape, to check divisibility)."""
    spec = logical_to_spec(logical_axes, rules)
    if shape is not None:
        spec = _fits(shape, spec, mesh)
    return NamedSharding(mesh, spec)


def batch_sharding(mesh: Mesh, ndim: int, shape: Sequence[int] | None = None) -> NamedSharding:
    """Sharding for a ``[B, ...]`` batch array: batch over (data, fsdp), rest replicated."""
    return named_sharding(mesh, ("batch",) + (None,) * (ndim - 1), shape)


def data_parallel_size(mesh: Mesh) -> int:
    return mesh.shape["data"] * mesh.shape["fsdp"]


def reshard(tree, shardings):
    """Moves a pytree of arrays to new shardings (e.g. FSDP training layout -> tensor-parallel
    decode layout) with one explicit ``jax.device_put``: devices exchange shards directly,
    nothing is gathered on one host. ``shardings`` mirrors ``tree`` (or is one sharding)."""
    return jax.device_put(tree, shardings)


def decode_mesh(mesh: Mesh, tensor: int) -> Mesh:
    """The rollout's mesh over ``mesh``'s devices: replicas of ``tensor`` chips split the
    weights over ``tensor`` and the decode slots over ``data`` (``devices / tensor``
    replicas). Consecutive devices form a replica, so a replica stays within a host."""
    devices = list(mesh.devices.flat)
    if tensor < 1 or len(devices) % tensor:
        raise ValueError(f"mesh.decode_tensor={tensor} does not divide the {len(devices)} "
                         "devices into tensor-parallel replicas")
    return make_mesh({"data": len(devices) // tensor, "tensor": tensor}, devices)


def layout_rules(kind: str) -> dict[str, str | tuple[str, ...] | None]:
    """Rule tables for the two layouts a run moves weights between.

    ``train``: ``LOGICAL_RULES`` (FSDP over ``fsdp``, heads/mlp/vocab over ``tensor``).
    ``decode``: weights replicated over the batch axes and split only over ``tensor`` (decode
    is bandwidth-bound; gathering FSDP shards every token would dominate).
    """
    if kind == "train":
        return dict(LOGICAL_RULES)
    if kind == "decode":
        return {**LOGICAL_RULES, "embed": None}
    raise ValueError(f"layout must be 'train' or 'decode', got {kind!r}")
