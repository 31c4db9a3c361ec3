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
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from tppo_jax.kernels.paged_attention import paged_attention, paged_attention_prefill
from tppo_jax.rollout import pages as pg

Array = jax.Array


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
    """

    pages: pg.PageState
    k: Array
    v: Array
    slots: Array
    impl: str = struct.field(pytree_node=False, default="auto")

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
        k_all, v_all = pg.write_kv(self.k, self.v, self.pages, self.slots, positions, k, v,
                                   valid, layer=layer_idx)
        kp, vp = k_all[layer_idx], v_all[layer_idx]
        top = jnp.max(jnp.where(valid, positions + 1, 0), axis=1)  # [B]
        slot_len = self.pages.slot_len.at[self.slots].max(top)
        pages = self.pages.replace(slot_len=slot_len)
        table, lengths = pg.attention_inputs(pages, self.slots)
        if q.shape[1] == 1:
            # Decode: the query at position p sees exactly [0, p] (its own causal limit, even
            # if the slot holds more, e.g. when a prefix is recomputed).
            q_len = jnp.where(valid[:, 0], positions[:, 0] + 1, lengths)
            out = paged_attention(q[:, 0], kp, vp, q_len, table, impl=self.impl)[:, None]
        else:
            q_pos = jnp.where(valid, positions, -1)
            out = paged_attention_prefill(q, kp, vp, lengths, table, q_pos)
        new = self.replace(pages=pages, k=k_all, v=v_all)
        return out.astype(q.dtype), new
