"""``PagedKVCache``: the ``KVCache`` protocol over the page pool of ``rollout.pages``.

The decoder hands each layer's new ``k, v`` to ``update_and_attend``; this cache scatters them
into the slot's pages (``pages.write_kv``) and attends with the paged kernels
(``paged_attention`` for one-token decode, ``paged_attention_prefill`` for multi-token).

Row ``b`` of the batch is slot ``slots[b]`` of the pool. Pages must be reserved *before* the
forward (``pages.reserve``); writes into positions without a page, or into shared prompt
pages, are dropped by ``write_kv`` (never corrupting another sample). Like ``DenseKVCache``,
each layer call raises ``slot_len`` to cover the positions written (an idempotent max, so
calling it once per layer is harmless).

Pool layout: ``k, v [L, Hkv, num_pages, page_size, D]`` (layer-major, then the kernel layout).

Split pools (``PoolSplit``, several processes): the slot axis and the page axis are cut into
the same ``G`` blocks over the mesh's batch axes, one block per batch shard. Block ``g`` holds
slots ``[g * S/G, (g+1) * S/G)`` and pages ``[g * N/G, (g+1) * N/G)``; the page ids in its
table rows are local to the block (``0 .. N/G - 1``). Every paged operation then runs per
block under ``jax.shard_map`` on the unchanged single-pool code of ``rollout.pages``: no page
of one block is ever read or written by another, so a host's pages serve only its own slots
(the batch axes span the hosts, so each host holds whole blocks).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tppo_jax.kernels.choice import current_mesh
from tppo_jax.kernels.paged_attention import paged_attention, paged_attention_prefill
from tppo_jax.parallel.mesh import batch_sharding
from tppo_jax.rollout import pages as pg

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class PoolSplit:
    """How a paged pool is cut over a mesh (static: hashable, part of the jit cache key).

    Attributes:
      mesh: the decode mesh.
      batch: the mesh axes the slot and page axes are split over (the batch axes that divide
        the slot count, as ``batch_sharding`` lays the per-slot rows out).
      heads: the mesh axis the kv heads are split over, or None (replicated).
    """

    mesh: Mesh
    batch: tuple[str, ...]
    heads: str | None

    @classmethod
    def make(cls, mesh: Mesh, num_slots: int, num_kv_heads: int, num_heads: int
             ) -> PoolSplit:
        """The split of a pool of ``num_slots`` slots on ``mesh``: slots (and pages) as the
        per-slot rows are laid out, heads over ``tensor`` when it divides both head counts."""
        entry = batch_sharding(mesh, 1, (num_slots,)).spec[0]
        batch = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        t = mesh.shape.get("tensor", 1)
        heads = "tensor" if t > 1 and num_kv_heads % t == 0 and num_heads % t == 0 else None
        return cls(mesh, batch, heads)

    @property
    def groups(self) -> int:
        """G: blocks of slots and pages (batch shards)."""
        return math.prod(self.mesh.shape[a] for a in self.batch)

    @property
    def _entry(self) -> str | tuple[str, ...] | None:
        """The batch axes as one spec entry (as ``batch_sharding`` writes it)."""
        return None if not self.batch else self.batch[0] if len(self.batch) == 1 else self.batch

    @property
    def rows(self) -> P:
        """Spec of a ``[S, ...]`` / ``[N, ...]`` array: split into the G blocks."""
        return P(self._entry)

    @property
    def pool(self) -> P:
        """Spec of a ``[L, Hkv, N, page_size, D]`` pool."""
        return P(None, self.heads, self._entry, None, None)

    def block_index(self) -> Array:
        """Inside ``run``: this block's index g (int32 scalar; 0 without batch axes)."""
        return jax.lax.axis_index(self.batch) if self.batch else jnp.int32(0)

    def run(self, fn: Callable[..., Any], in_specs: tuple[Any, ...], out_specs: Any
            ) -> Callable[..., Any]:
        """``fn`` run on every block's local arrays (``jax.shard_map``; specs as above)."""
        return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs,
                             check_vma=False)

    def shardings(self) -> tuple[NamedSharding, NamedSharding]:
        """``(rows, pool)`` shardings, to create the cache in place."""
        return NamedSharding(self.mesh, self.rows), NamedSharding(self.mesh, self.pool)


def init_pools(num_layers: int, num_kv_heads: int, num_pages: int, page_size: int,
               head_dim: int, dtype: jnp.dtype = jnp.float32) -> tuple[Array, Array]:
    """Zeroed ``(k, v)`` pools, each ``[L, Hkv, num_pages, page_size, D]``."""
    shape = (num_layers, num_kv_heads, num_pages, page_size, head_dim)
    return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)


@struct.dataclass
class PagedKVCache:
    """Per-layer page pools + page table, viewed through a batch of slots.

    Attributes:
      pages: ``PageState`` (page table ``[S, M]``, refcounts ``[N]``, ``slot_len [S]``).
      k, v: ``[L, Hkv, N, page_size, D]`` pools.
      slots: ``[B]`` int32, the slot each batch row reads and writes.
      impl: static paged-attention implementation for decode (see the kernels module).
      split: static ``PoolSplit`` (pool cut into per-shard blocks, page ids local to the
        block; then a batch is G equal parts, part g slots of block g: all ``S`` slots in
        order, or a few of each block's, ``DecodeEngine.prefill_gathered``) or None (one
        pool).
    """

    pages: pg.PageState
    k: Array
    v: Array
    slots: Array
    impl: str = struct.field(pytree_node=False, default="auto")
    split: PoolSplit | None = struct.field(pytree_node=False, default=None)

    def update_and_attend(
        self,
        layer_idx: Array | int,
        q: Array,
        k: Array,
        v: Array,
        positions: Array,
        valid: Array,
    ) -> tuple[Array, PagedKVCache]:
        """See ``KVCache.update_and_attend``. q ``[B,T,Hq,D]``, k/v ``[B,T,Hkv,D]``,
        positions/valid ``[B,T]`` -> (out ``[B,T,Hq,D]``, cache)."""
        positions = positions.astype(jnp.int32)
        valid = valid.astype(bool)
        layer_idx = jnp.asarray(layer_idx, jnp.int32)
        if self.split is None:
            # one pool: a Pallas kernel runs per shard of the program's mesh
            out, pages, k_all, v_all = _write_and_attend(
                self.impl, self.pages, self.k, self.v, self.slots, q, k, v, positions, valid,
                layer_idx, current_mesh())
            return out, self.replace(pages=pages, k=k_all, v=v_all)
        sp = self.split
        if q.shape[0] % sp.groups:
            raise ValueError(f"a split paged pool takes a batch of whole blocks (a multiple "
                             f"of {sp.groups} rows), got {q.shape[0]}")

        def local(pages, k_pool, v_pool, slots, q, k, v, positions, valid, layer_idx):
            slots = slots - sp.block_index() * pages.num_slots  # global -> block-local
            return _write_and_attend(self.impl, pages, k_pool, v_pool, slots, q, k, v,
                                     positions, valid, layer_idx)

        heads = P(sp._entry, None, sp.heads, None)
        rows = sp.rows
        out, pages, k_all, v_all = sp.run(
            local, (rows, sp.pool, sp.pool, rows, heads, heads, heads, rows, rows, P()),
            (heads, rows, sp.pool, sp.pool))(
            self.pages, self.k, self.v, self.slots, q, k, v, positions, valid, layer_idx)
        return out, self.replace(pages=pages, k=k_all, v=v_all)

    def write(self, layer_idx: Array | int, k: Array, v: Array, positions: Array,
              valid: Array) -> PagedKVCache:
        """See ``KVCache.write``: k/v ``[B,T,Hkv,D]`` into the pages, no attention."""
        positions = positions.astype(jnp.int32)
        valid = valid.astype(bool)
        layer_idx = jnp.asarray(layer_idx, jnp.int32)
        if self.split is None:
            pages, k_all, v_all = _write(self.pages, self.k, self.v, self.slots, k, v,
                                         positions, valid, layer_idx)
            return self.replace(pages=pages, k=k_all, v=v_all)
        sp = self.split

        def local(pages, k_pool, v_pool, slots, k, v, positions, valid, layer_idx):
            slots = slots - sp.block_index() * pages.num_slots  # global -> block-local
            return _write(pages, k_pool, v_pool, slots, k, v, positions, valid, layer_idx)

        heads, rows = P(sp._entry, None, sp.heads, None), sp.rows
        pages, k_all, v_all = sp.run(
            local, (rows, sp.pool, sp.pool, rows, heads, heads, rows, rows, P()),
            (rows, sp.pool, sp.pool))(
            self.pages, self.k, self.v, self.slots, k, v, positions, valid, layer_idx)
        return self.replace(pages=pages, k=k_all, v=v_all)


def _write(pages: pg.PageState, k_pool: Array, v_pool: Array, slots: Array, k: Array,
           v: Array, positions: Array, valid: Array, layer_idx: Array
           ) -> tuple[pg.PageState, Array, Array]:
    """Scatters ``k, v [B,T,Hkv,D]`` into ``k_pool, v_pool [L,Hkv,N,ps,D]`` at the rows'
    slots (``[B]``) and extends their lengths. Returns ``(pages, k_pool, v_pool)``."""
    k_all, v_all = pg.write_kv(k_pool, v_pool, pages, slots, positions, k, v, valid,
                               layer=layer_idx)
    top = jnp.max(jnp.where(valid, positions + 1, 0), axis=1)  # [B]
    return pages.replace(slot_len=pages.slot_len.at[slots].max(top)), k_all, v_all


def _write_and_attend(impl: str, pages: pg.PageState, k_pool: Array, v_pool: Array,
                      slots: Array, q: Array, k: Array, v: Array, positions: Array,
                      valid: Array, layer_idx: Array, mesh: Any = None
                      ) -> tuple[Array, pg.PageState, Array, Array]:
    """One layer on one pool: scatter ``k, v [B,T,Hkv,D]`` into ``k_pool, v_pool
    [L,Hkv,N,ps,D]`` at the rows' slots (``[B]``, ids into ``pages``) and attend with ``q
    [B,T,Hq,D]``. ``mesh``: the program's, when this is not already one block of a split
    pool (the decode kernel then runs per shard on it). Returns ``(out [B,T,Hq,D], pages,
    k_pool, v_pool)``."""
    pages, k_all, v_all = _write(pages, k_pool, v_pool, slots, k, v, positions, valid,
                                 layer_idx)
    kp, vp = k_all[layer_idx], v_all[layer_idx]
    table, lengths = pg.attention_inputs(pages, slots)
    if q.shape[1] == 1:
        # Decode: the query at position p sees exactly [0, p] (its own causal limit, even
        # if the slot holds more, e.g. when a prefix is recomputed).
        q_len = jnp.where(valid[:, 0], positions[:, 0] + 1, lengths)
        out = paged_attention(q[:, 0], kp, vp, q_len, table, impl=impl, mesh=mesh)[:, None]
    else:
        q_pos = jnp.where(valid, positions, -1)
        out = paged_attention_prefill(q, kp, vp, lengths, table, q_pos)
    return out.astype(q.dtype), pages, k_all, v_all
