"""The decode engine's programs with the arguments they run on: the engine's program table,
read by the compile path (``tppo plan --compile``) and the accelerator benchmark.

``prefill_slots`` (a batched prefill into the slots), ``prefill_gathered`` (a few slots'
rows: the preempted rows' re-prefill) and ``generate_window`` (one window of
up to ``l`` tokens per slot: the decode core's loop) are the engine's own jitted programs,
reached through its public ``DecodeEngine.lowered``: they are traced on the engine's program
mesh, so their kernels are those of that mesh's platform (``kernels.choice``: the TPU
paged-attention kernel for a TPU topology's abstract devices, whatever machine compiles).
Their decode state is the engine's own empty one (``init_decode_state``), abstract and laid
out as the engine makes it.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from tppo_jax.models.cache import DenseKVCache
from tppo_jax.parallel.mesh import logical_to_spec
from tppo_jax.programs import Lowering, Program, on_mesh, sds
from tppo_jax.rollout import pages as pg
from tppo_jax.rollout.engine import DecodeEngine, DecodeState, EngineParams
from tppo_jax.rollout.paged_cache import PagedKVCache


def abstract_decode_state(engine: DecodeEngine, mesh: Any) -> DecodeState:
    """The engine's empty ``DecodeState`` as abstract arrays laid out as the engine makes it:
    a dense cache sharded over its mesh (``DenseKVCache.layout``), a paged pool split into
    per-shard blocks (``kv_slots.new_cache``: ``eval_shape`` drops the layout of a jit nested
    in the traced function), the rest replicated on ``mesh``."""
    ds = jax.eval_shape(engine.init_decode_state)
    c = ds.cache
    if isinstance(c, DenseKVCache) and engine.cache_mesh is not None:
        ds = ds.replace(cache=jax.tree.map(
            sds, c, DenseKVCache.layout(engine.cache_mesh, c.k.shape)))
    elif isinstance(c, PagedKVCache) and c.split is not None and c.split.groups > 1:
        rows, pool = c.split.shardings()
        layout = PagedKVCache(pg.PageState(rows, rows, rows, c.pages.page_size), pool, pool,
                              rows, c.impl, c.split)
        ds = ds.replace(cache=jax.tree.map(sds, c, layout))
    return on_mesh(ds, mesh)


def abstract_params(policy: nnx.Module, mesh: Any) -> EngineParams:
    """The weights the engine decodes with (``policy``'s state, abstract or real) and a
    policy version, as ``DecodeEngine.load_params`` hands them to its programs."""
    version = jax.ShapeDtypeStruct((), jnp.int32,
                                   sharding=None if mesh is None else
                                   NamedSharding(mesh, PartitionSpec()))
    return EngineParams(state=nnx.state(policy), version=version)


def _slot_rows(engine: DecodeEngine, mesh: Any, dtype: Any, width: int | None = None) -> Any:
    """A per-slot ``[S]`` (``[S, width]``) argument, its rows split over ``mesh``'s batch
    axes (``DecodeEngine.put_rows``)."""
    s = engine.max_slots
    shape = (s,) if width is None else (s, width)
    sh = None if mesh is None else NamedSharding(mesh, logical_to_spec(("batch",)))
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sh)


def prefill_program(engine: DecodeEngine, params: EngineParams, state: DecodeState,
                    width: int, *, name: str, kind: str, mesh: Any,
                    holds: tuple[str, ...] = ()) -> Program:
    """``prefill_slots`` of ``[S, width]`` prompt tokens into every slot of ``state``."""
    args = (params, state, _slot_rows(engine, mesh, jnp.int32, width),
            _slot_rows(engine, mesh, jnp.int32), _slot_rows(engine, mesh, jnp.bool_))
    return Program(name, kind, Lowering(lambda *a: engine.lowered("prefill_slots", *a)),
                   args, {"slots": engine.max_slots, "width": width}, holds)


def gathered_program(engine: DecodeEngine, params: EngineParams, state: DecodeState,
                     width: int, *, name: str, kind: str, mesh: Any,
                     holds: tuple[str, ...] = ()) -> Program:
    """``prefill_gathered`` of ``engine.gather_rows(width)`` rows per page block at ``width``
    columns into their slots of ``state`` (the preempted rows' re-prefill)."""
    rows = engine.page_blocks * engine.gather_rows(width)
    sh = None if mesh is None else NamedSharding(mesh, logical_to_spec(("batch",)))
    arg = lambda dtype, *shape: jax.ShapeDtypeStruct((rows, *shape), dtype,  # noqa: E731
                                                     sharding=sh)
    args = (params, state, arg(jnp.int32, width), arg(jnp.int32), arg(jnp.int32),
            arg(jnp.bool_))
    return Program(name, kind, Lowering(lambda *a: engine.lowered("prefill_gathered", *a)),
                   args, {"slots": engine.max_slots, "rows": rows, "width": width}, holds)


def window_program(engine: DecodeEngine, params: EngineParams, state: DecodeState,
                   window: int, *, name: str, kind: str, mesh: Any,
                   holds: tuple[str, ...] = ()) -> Program:
    """``generate_window`` of up to ``window`` tokens per slot of ``state`` (donated)."""
    args = (state, params, window, _slot_rows(engine, mesh, jnp.int32),
            _slot_rows(engine, mesh, jnp.bool_))
    return Program(name, kind, Lowering(lambda *a: engine.lowered("generate_window", *a)),
                   args, {"slots": engine.max_slots, "window": window}, holds)


__all__ = ["abstract_decode_state", "abstract_params", "gathered_program", "prefill_program",
           "window_program"]
