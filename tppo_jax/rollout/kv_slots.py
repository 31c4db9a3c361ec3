"""Slot operations on a KV cache: the one owner of pool set-up, page budgets, prompt sharing,
window reservation and freeing.

The engine calls these on whatever cache it decodes with. For a ``PagedKVCache`` they move
pages (``rollout.pages`` holds the pure page-table arithmetic); for a ``DenseKVCache`` every
slot owns a full row, so reserving always succeeds and freeing just resets the row length.
All device functions are pure and jittable; ``pages_for`` / ``admission_room`` are the
host-side budget rule the scheduler admits prompts with.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tppo_jax.models.cache import DenseKVCache
from tppo_jax.rollout import pages as pg
from tppo_jax.rollout.paged_cache import PagedKVCache, init_pools

Array = jax.Array
Cache = DenseKVCache | PagedKVCache


def new_cache(config: Any, num_slots: int, max_len: int, *, kind: str = "dense",
              page_size: int = 16, num_pages: int = 0, mesh: Any = None,
              attn_impl: str = "auto") -> Cache:
    """An empty cache for ``num_slots`` sequences of up to ``max_len`` positions.

    ``kind="paged"``: one pool of ``num_pages`` pages (0 = every slot at full length) shared
    by all slots; ``"dense"``: a ``[L, num_slots, max_len, Hkv, D]`` buffer, created in its
    sharded layout when a mesh is given.
    """
    c = config
    kind = resolve_kind(kind)
    if kind == "dense":
        args = (c.num_layers, num_slots, max_len, c.num_kv_heads, c.head_dim, c.jnp_dtype)
        return (DenseKVCache.init_on_mesh(mesh, *args) if mesh is not None
                else DenseKVCache.init(*args))
    max_pages = -(-max_len // page_size)
    n = num_pages or num_slots * max_pages
    k, v = init_pools(c.num_layers, c.num_kv_heads, n, page_size, c.head_dim, c.jnp_dtype)
    return PagedKVCache(pg.init(n, num_slots, max_pages, page_size), k, v,
                        jnp.arange(num_slots, dtype=jnp.int32), attn_impl)


def resolve_kind(kind: str) -> str:
    """``auto`` -> the cache that decodes faster here: ``paged`` on TPU/GPU (Pallas paged
    attention, no full-length rows), ``dense`` on CPU (``tppo bench decode`` measures the
    dense cache faster there: the reference paged kernel gathers every page) and across
    hosts (the paged pool is single-host)."""
    if kind != "auto":
        return kind
    if jax.process_count() > 1 or jax.default_backend() == "cpu":
        return "dense"
    return "paged"


def is_paged(cache: Cache) -> bool:
    return isinstance(cache, PagedKVCache)


def reserve(cache: Cache, rows: Array, upto: Array) -> tuple[Cache, Array]:
    """Room for positions ``[0, upto)`` in each masked slot. Returns ``(cache, ok [S])``;
    a slot that does not fit (pool short) is left untouched and reported, never overwriting
    a live page."""
    if not is_paged(cache):
        return cache, jnp.ones(rows.shape, bool)
    extra = jnp.maximum(upto - cache.pages.slot_len, 0)
    pages, ok = pg.reserve(cache.pages, rows, jnp.where(rows, extra, 0))
    return cache.replace(pages=pages), ok


def reserve_window(cache: Cache, upto: Array, first: Array, rest: Array
                   ) -> tuple[Cache, Array]:
    """``reserve`` for ``first`` rows (continuations), then for ``rest`` (fresh prompts), so a
    short pool stalls new work before it stalls work in flight. Returns ``(cache, ok [S])``."""
    cache, ok_first = reserve(cache, first, upto)
    cache, ok_rest = reserve(cache, rest, upto)
    return cache, ok_first & ok_rest


def free(cache: Cache, rows: Array) -> Cache:
    """Ends the masked slots: paged pages go back to the pool (a shared prompt page when its
    last holder leaves); a dense row is reused as is."""
    if not is_paged(cache):
        return cache.reset_rows(rows)
    return cache.replace(pages=pg.free(cache.pages, rows))


def share_prompt(cache: Cache, src: Array, dst: Array) -> tuple[Cache, Array]:
    """The other samples of a prompt take ``src``'s cached prompt: full pages by reference
    (refcount), a private copy of the partial tail page. ``dst`` slots must be empty. Paged
    only. Returns ``(cache, ok [S])``."""
    pages, ok, tail_src, tail_dst = pg.share_prefix(cache.pages, src, dst)
    k, v = jax.vmap(lambda kl, vl: pg.copy_pages(kl, vl, tail_src, tail_dst))(cache.k, cache.v)
    return cache.replace(pages=pages, k=k, v=v), ok


def pages_in_use(cache: Cache) -> int:
    """Pages with refcount > 0 (a shared page counts once); 0 for a dense cache."""
    if not is_paged(cache):
        return 0
    return cache.pages.num_pages - int(pg.num_free_pages(cache.pages))


# ------------------------------------------------------------------ host-side budget rule
def pages_for(tokens: int, page_size: int) -> int:
    """Pages holding ``tokens`` positions."""
    return -(-max(int(tokens), 0) // page_size)


def admission_room(cache: Cache, live: np.ndarray, position: np.ndarray, window: int) -> int:
    """Free pages left for fresh prompts once every live slot has room for its next window
    (continuations come first). A large number for a dense cache (no page budget)."""
    if not is_paged(cache):
        return np.iinfo(np.int32).max
    ps = cache.pages.page_size
    held = np.asarray(pg.pages_held(cache.pages))
    grow = sum(max(pages_for(int(position[r]) + window, ps) - int(held[r]), 0)
               for r in np.flatnonzero(live))
    return int(pg.num_free_pages(cache.pages)) - grow
