"""A jitted program and the abstract arguments it runs on: the record of the learner's and
the engine's program tables (``learner.programs``, ``rollout.programs``), which the compile
path (``tppo_jax.compile``) and the accelerator benchmark lower and compile.

A program's function is the one the run calls (its shardings and donation declared where
it is jitted); its arguments are ``jax.ShapeDtypeStruct``s laid out on the program's mesh
(or real arrays), built from the functions that make the real ones, so what compiles is what
runs. Nothing here imports above ``jax``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec


@dataclass(frozen=True)
class Program:
    """One program of a step: ``fn.lower(*args)`` is what ``tppo plan --compile`` compiles.

    name: as the compiled report names it (``policy_update[w=256]``); kind: the group
    ``--programs`` selects; fn: the jitted function (anything with ``lower``); args: its
    arguments, abstract or real (a static argument as its value); meta: what it covers
    (rows, width, slots, ...), copied into its report record; holds: the live state it
    takes as arguments (by the names the compile path's ``live`` uses), so it is not
    counted twice.
    """

    name: str
    kind: str
    fn: Any
    args: tuple[Any, ...] = ()
    meta: dict[str, Any] = field(default_factory=dict)
    holds: tuple[str, ...] = ()

    def lower(self) -> Any:
        """The program lowered for its arguments (a jax ``Lowered``)."""
        return self.fn.lower(*self.args)


@dataclass(frozen=True)
class Lowering:
    """A ``lower`` for a program reached through a caller's own lowering entry (a public
    ``f(*args) -> Lowered``), where the jitted function itself is not exposed."""

    lower: Callable[..., Any]


def sds(x: Any, sharding: Any) -> jax.ShapeDtypeStruct:
    """``x``'s shape and dtype with ``sharding``."""
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


def on_mesh(tree: Any, mesh: Any) -> Any:
    """``tree`` with every leaf that has no ``NamedSharding`` (what a run creates uncommitted:
    a paged KV pool, step counts, scalars) as replicated on ``mesh``, as a jitted step
    receives them; ``tree`` itself without a mesh."""
    if mesh is None:
        return tree
    rep = NamedSharding(mesh, PartitionSpec())
    return jax.tree.map(lambda x: x if isinstance(getattr(x, "sharding", None), NamedSharding)
                        else sds(x, rep), tree)


def per_chip_bytes(tree: Any) -> int:
    """Bytes of one device's shard of every array in ``tree`` (the largest shard)."""
    n = 0
    for x in jax.tree.leaves(tree):
        shape = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) else x.shape
        n += math.prod(shape) * jnp.dtype(x.dtype).itemsize
    return n


__all__ = ["Lowering", "Program", "on_mesh", "per_chip_bytes", "sds"]
