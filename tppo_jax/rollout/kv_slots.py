"""Slot operations on a KV cache: the one owner of pool set-up, page budgets, prompt writing
and sharing, window reservation, freeing, and the on-demand allocator's plan (``plan_chunk``).

The engine calls these on whatever cache it decodes with. For a ``PagedKVCache`` they move
pages (``rollout.pages`` holds the pure page-table arithmetic); for a ``DenseKVCache`` every
slot owns a full row, so reserving always succeeds and freeing just resets the row length.
All device functions are pure and jittable; ``pages_for`` / ``admission_room`` are the
host-side budget rule the scheduler admits prompts with.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tppo_jax.models.cache import DenseKVCache
from tppo_jax.parallel.multihost import global_to_host
from tppo_jax.rollout import pages as pg
from tppo_jax.rollout.paged_cache import PagedKVCache, PoolSplit, init_pools

Array = jax.Array
Cache = DenseKVCache | PagedKVCache


def new_cache(config: Any, num_slots: int, max_len: int, *, kind: str = "dense",
              page_size: int = 16, num_pages: int = 0, mesh: Any = None,
              attn_impl: str = "auto", split_pages: bool = False) -> Cache:
    """An empty cache for ``num_slots`` sequences of up to ``max_len`` positions.

    ``kind="paged"``: ``num_pages`` pages (0 = every slot at full length) for all slots: one
    pool shared by all slots, or, with ``split_pages`` and a mesh, ``G`` blocks of
    ``num_slots / G`` slots and ``num_pages / G`` pages, one per batch shard
    (``paged_cache.PoolSplit``: each host's pages serve its own slots), created in place.
    ``"dense"``: a ``[L, num_slots, max_len, Hkv, D]`` buffer, created in its sharded layout
    when a mesh is given.
    """
    c = config
    kind = resolve_kind(kind)
    if kind == "dense":
        args = (c.num_layers, num_slots, max_len, c.num_kv_heads, c.head_dim, c.jnp_dtype)
        return (DenseKVCache.init_on_mesh(mesh, *args) if mesh is not None
                else DenseKVCache.init(*args))
    max_pages = -(-max_len // page_size)
    n = num_pages or num_slots * max_pages
    split = (PoolSplit.make(mesh, num_slots, c.num_kv_heads, c.num_heads)
             if split_pages and mesh is not None else None)
    if split is None or split.groups == 1:
        k, v = init_pools(c.num_layers, c.num_kv_heads, n, page_size, c.head_dim, c.jnp_dtype)
        return PagedKVCache(pg.init(n, num_slots, max_pages, page_size), k, v,
                            jnp.arange(num_slots, dtype=jnp.int32), attn_impl)
    g = split.groups
    if num_slots % g or n % g:
        raise ValueError(f"a paged pool split over {g} batch shards needs slots ({num_slots}) "
                         f"and pages ({n}) divisible by {g}")
    rows, pool = split.shardings()

    def make() -> PagedKVCache:
        k, v = init_pools(c.num_layers, c.num_kv_heads, n, page_size, c.head_dim, c.jnp_dtype)
        block = pg.init(n // g, num_slots // g, max_pages, page_size)
        pages = pg.PageState(page_table=jnp.tile(block.page_table, (g, 1)),
                             refcount=jnp.tile(block.refcount, g),
                             slot_len=jnp.tile(block.slot_len, g), page_size=page_size)
        return PagedKVCache(pages, k, v, jnp.arange(num_slots, dtype=jnp.int32), attn_impl,
                            split)

    shardings = PagedKVCache(pg.PageState(rows, rows, rows, page_size), pool, pool, rows,
                             attn_impl, split)
    return jax.jit(make, out_shardings=shardings)()


def resolve_kind(kind: str) -> str:
    """``auto`` -> the cache that decodes faster here: ``paged`` on TPU/GPU, one host or
    many (Pallas paged attention, no full-length rows; across hosts each batch shard holds
    its own block of the pool, ``new_cache``), ``dense`` on CPU, one process or several
    (``tppo bench decode`` measures the dense cache faster there: the reference paged
    kernel gathers every page)."""
    if kind != "auto":
        return kind
    return "dense" if jax.default_backend() == "cpu" else "paged"


def is_paged(cache: Cache) -> bool:
    return isinstance(cache, PagedKVCache)


def _split(cache: PagedKVCache) -> PoolSplit | None:
    """The cache's ``PoolSplit`` when it has more than one block."""
    sp = cache.split
    return sp if sp is not None and sp.groups > 1 else None


def reserve(cache: Cache, rows: Array, upto: Array) -> tuple[Cache, Array]:
    """Room for positions ``[0, upto)`` in each masked slot. Returns ``(cache, ok [S])``;
    a slot that does not fit (pool short) is left untouched and reported, never overwriting
    a live page."""
    if not is_paged(cache):
        return cache, jnp.ones(rows.shape, bool)
    sp = _split(cache)
    if sp is None:
        pages, ok = reserve_pages(cache.pages, rows, upto)
    else:  # each block from its own free pages
        pages, ok = sp.run(reserve_pages, (sp.rows,) * 3, (sp.rows, sp.rows))(
            cache.pages, rows, upto)
    return cache.replace(pages=pages), ok


def reserve_pages(pages: pg.PageState, rows: Array, upto: Array) -> tuple[pg.PageState, Array]:
    """``pg.reserve`` of positions ``[0, upto [S])`` for the ``rows [S]`` slots."""
    extra = jnp.maximum(upto - pages.slot_len, 0)
    return pg.reserve(pages, rows, jnp.where(rows, extra, 0))


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
    sp = _split(cache)
    if sp is None:
        return cache.replace(pages=pg.free(cache.pages, rows))
    return cache.replace(pages=sp.run(pg.free, (sp.rows, sp.rows), sp.rows)(cache.pages, rows))


def write_prefix(cache: Cache, k: Array, v: Array, length: Array, slot: Array, ok: Array
                 ) -> Cache:
    """A prefilled prompt's ``k, v [L, P, Hkv, D]`` (its first ``length`` positions) into
    ``slot`` when ``ok`` (pages already reserved for a paged cache)."""
    p = k.shape[1]
    pos = jnp.arange(p, dtype=jnp.int32)[None]
    valid = (pos < length) & ok
    if is_paged(cache):
        def write(kl, vl, pk, pv):
            return pg.write_kv(kl, vl, cache.pages, slot[None], pos, pk[None], pv[None], valid)

        k, v = jax.vmap(write)(cache.k, cache.v, k.astype(cache.k.dtype),
                               v.astype(cache.v.dtype))
        slot_len = cache.pages.slot_len.at[slot].set(jnp.where(ok, length, 0))
        return cache.replace(pages=cache.pages.replace(slot_len=slot_len), k=k, v=v)
    keep = valid[0][None, :, None, None]
    k_row = jnp.where(keep, k.astype(cache.k.dtype), cache.k[:, slot, :p])
    v_row = jnp.where(keep, v.astype(cache.v.dtype), cache.v[:, slot, :p])
    return cache.replace(k=cache.k.at[:, slot, :p].set(k_row),
                         v=cache.v.at[:, slot, :p].set(v_row),
                         lengths=cache.lengths.at[slot].set(jnp.where(ok, length, 0)))


def share_prompts(cache: PagedKVCache, src: Array, dst: Array
                  ) -> tuple[PagedKVCache, Array, Array]:
    """The other samples of a prompt take its cached prompt, one prompt per page block at
    once (one block without a split): full pages by reference (refcount), a private copy of
    the partial tail page. In each block the ``dst [S]`` slots (empty) take the prompt of the
    block's ``src [S]`` slot (at most one per block). Paged only. ``dst`` slots of a block
    without a source get ``ok = False`` (untouched). Returns ``(cache, ok [S], src_of [S])``:
    ``src_of`` is each slot's block source (a slot id; meaningful where ``dst & ok``)."""
    src, dst = jnp.asarray(src, bool), jnp.asarray(dst, bool)
    sp = _split(cache)
    g = 1 if sp is None else sp.groups
    n = cache.pages.num_slots // g
    first = jnp.argmax(src.reshape(g, n), axis=1) + jnp.arange(g) * n
    src_of = jnp.repeat(first, n).astype(jnp.int32)
    if sp is None:
        pages, k, v, ok = _share_local(cache.pages, cache.k, cache.v, src, dst)
    else:
        pages, k, v, ok = sp.run(_share_local, (sp.rows, sp.pool, sp.pool, sp.rows, sp.rows),
                                 (sp.rows, sp.pool, sp.pool, sp.rows))(
            cache.pages, cache.k, cache.v, src, dst)
    return cache.replace(pages=pages, k=k, v=v), ok, src_of


def _share_local(pages: pg.PageState, k: Array, v: Array, src: Array, dst: Array
                 ) -> tuple[pg.PageState, Array, Array, Array]:
    """One pool (pages, ``k, v [L, Hkv, N, ps, D]``): the ``dst [S]`` slots take the prompt
    of the ``src [S]`` slot (the first True; none: nothing shared, ``ok = ~dst``).
    Returns ``(pages, k, v, ok [S])``."""
    has = jnp.any(src)
    pages, ok, tail_src, tail_dst = pg.share_prefix(pages, jnp.argmax(src), dst & has)
    k, v = jax.vmap(lambda kl, vl: pg.copy_pages(kl, vl, tail_src, tail_dst))(k, v)
    return pages, k, v, ok & (has | ~dst)


def is_split(cache: Cache) -> bool:
    """A paged pool cut into per-shard blocks (``paged_cache.PoolSplit``)."""
    return is_paged(cache) and _split(cache) is not None


def pages_in_use(cache: Cache) -> int:
    """Pages with refcount > 0 (a shared page counts once); 0 for a dense cache."""
    if not is_paged(cache):
        return 0
    return int(jnp.sum(cache.pages.refcount > 0))


# ------------------------------------------------------------------ host-side budget rule
def pages_for(tokens: int, page_size: int) -> int:
    """Pages holding ``tokens`` positions."""
    return -(-max(int(tokens), 0) // page_size)


def host_blocks(cache: Cache) -> int:
    """How many page blocks this host's slots are split into (1: one pool, or dense)."""
    if not is_paged(cache) or _split(cache) is None:
        return 1
    return cache.split.groups // jax.process_count()


def host_pages(cache: PagedKVCache) -> tuple[np.ndarray, np.ndarray]:
    """This host's ``(pages held [S_host], refcount [N_host])``, read from the shards it
    holds (no cross-host transfer); the whole pool when it is not split."""
    if _split(cache) is None:
        return np.asarray(pg.pages_held(cache.pages)), np.asarray(cache.pages.refcount)
    table = global_to_host(cache.pages.page_table)
    return (table >= 0).sum(axis=1).astype(np.int32), global_to_host(cache.pages.refcount)


def block_room(held: np.ndarray, refcount: np.ndarray, blocks: int, live: np.ndarray,
               position: np.ndarray, window: int, page_size: int) -> np.ndarray:
    """Free pages of each of ``blocks`` page blocks once every live slot in the block has
    room for its next window (continuations come first). Pure numpy.

    Args: held ``[S]`` pages held per slot; refcount ``[N]`` (block ``b``: slots
      ``[b*S/blocks, (b+1)*S/blocks)``, pages ``[b*N/blocks, (b+1)*N/blocks)``); live ``[S]``
      bool; position ``[S]`` tokens cached per slot.
    Returns: ``[blocks]`` int64 (negative: continuations alone overdraw the block).
    """
    n = refcount.shape[0]
    free = (refcount == 0).reshape(blocks, n // blocks).sum(axis=1)
    return window_room(free, held, live, position, window, page_size)


def window_room(free: np.ndarray, held: np.ndarray, live: np.ndarray, position: np.ndarray,
                window: int, page_size: int) -> np.ndarray:
    """``block_room`` from each block's free pages ``free [blocks]``: what is left once
    every live slot has pages for ``position + window`` tokens. ``[blocks]`` int64."""
    blocks, s = len(free), held.shape[0]
    want = -(-(np.asarray(position, np.int64) + window) // page_size)
    grow = np.where(live, np.maximum(want - held, 0), 0)
    return (np.asarray(free, np.int64) - grow.reshape(blocks, s // blocks).sum(axis=1))


def admit_rows(free_rows: np.ndarray, room: np.ndarray, per_block: int,
               need: Callable[[int], int]) -> tuple[list[tuple[int, int]], int]:
    """The admission rule: the slots ``free_rows`` (ascending) take the waiting requests in
    queue order while their page block has ``room`` (``[blocks]`` pages, spent as rows are
    admitted); ``need(i)`` is the pages the ``i``-th waiting request takes. A block that cannot
    take the next request takes none after it this step (its slots wait, so requests keep
    their order). Returns ``([(row, request index)], requests deferred)``: admitted in order,
    request indices ``0, 1, ...``; a deferral counts each time a block turns the head away."""
    room = np.array(room, np.int64)
    full = np.zeros(len(room), bool)
    out: list[tuple[int, int]] = []
    deferred = 0
    for r in free_rows:
        block = int(r) // per_block
        if full[block]:
            continue
        k = need(len(out))
        if k > room[block]:
            deferred += 1
            full[block] = True
            if full.all():
                break
            continue
        room[block] -= k
        out.append((int(r), len(out)))
    return out, deferred


def readmit_rows(order: np.ndarray, room: np.ndarray, per_block: int, need: np.ndarray
                 ) -> np.ndarray:
    """Preempted rows back into their own slots, in ``order`` (oldest first), while their
    block has ``room`` for their ``need [S]`` pages (a re-prefill); a block that cannot take
    its oldest takes none after it. Returns ``[S]`` bool."""
    room = np.array(room, np.int64)
    full = np.zeros(len(room), bool)
    out = np.zeros(need.shape[0], bool)
    for r in order:
        b = int(r) // per_block
        if full[b] or need[r] > room[b]:
            full[b] = True
            continue
        room[b] -= need[r]
        out[r] = True
    return out


def preempt_rows(short: np.ndarray, gain: np.ndarray, candidates: np.ndarray,
                 age: np.ndarray) -> np.ndarray:
    """Which rows a block that runs dry preempts (frees; re-prefilled when room returns, as
    vLLM does): in each block short of ``short [blocks]`` pages, the youngest ``candidates``
    (largest ``age``: the latest admitted) until what preempting them gives back (``gain
    [S]``: the pages a row holds plus those it was about to take) covers the shortfall.
    Returns ``[S]`` bool."""
    blocks, s = len(short), gain.shape[0]
    per = s // blocks
    out = np.zeros(s, bool)
    for b in np.flatnonzero(np.asarray(short) > 0):
        rows = np.flatnonzero(candidates[b * per:(b + 1) * per]) + b * per
        got = 0
        for r in rows[np.argsort(-np.asarray(age)[rows], kind="stable")]:
            if got >= short[b]:
                break
            out[r] = True
            got += int(gain[r])
    return out


def _block_sum(x: np.ndarray, blocks: int) -> np.ndarray:
    return np.asarray(x, np.int64).reshape(blocks, -1).sum(axis=1)


def plan_chunk(free: np.ndarray, held: np.ndarray, private: np.ndarray, position: np.ndarray,
               n: np.ndarray, running: np.ndarray, candidates: np.ndarray, rank: np.ndarray,
               waiting: np.ndarray, age: np.ndarray, page_size: int
               ) -> tuple[np.ndarray, np.ndarray]:
    """The on-demand allocator's decision before each chunk of a window (pure numpy; the
    scheduler runs it, ``tppo bench page-replay`` replays it).

    The ``running [S]`` rows will write ``n [S]`` more tokens after their ``position [S]``
    cached ones, taking the pages that crosses (``held [S]`` held now). A block whose ``free
    [blocks]`` pages fall short preempts ``candidates`` (``preempt_rows``, highest ``rank``
    first; each gives back its ``private [S]`` pages, those no other slot shares, and the
    growth it no longer needs). Then the ``waiting [S]`` rows (preempted earlier, holding
    nothing) take their turn: candidates with nothing to write in this chunk (done with the
    window) give way to them, and they come back oldest (lowest ``age``) first while their
    block has the pages of their cache and their next chunk (``readmit_rows``; they are
    re-prefilled). Returns ``(preempt [S], readmit [S])`` bool."""
    blocks, s = len(free), held.shape[0]
    want = -(-(np.asarray(position, np.int64) + n) // page_size)
    active = running & (n > 0)
    grow = np.where(active, np.maximum(want - held, 0), 0)
    candidates = candidates & ~waiting
    preempt = preempt_rows(_block_sum(grow, blocks) - free, private + grow, candidates, rank)
    room = free - _block_sum(np.where(preempt, 0, grow), blocks) + _block_sum(
        np.where(preempt, private, 0), blocks)
    short = _block_sum(np.where(waiting, want, 0), blocks) - room
    idle = preempt_rows(short, private, candidates & ~active & ~preempt, rank)
    room += _block_sum(np.where(idle, private, 0), blocks)
    back = np.flatnonzero(waiting)
    back = back[np.argsort(np.asarray(age)[back], kind="stable")]
    return preempt | idle, readmit_rows(back, room, s // blocks, want)


def private_pages(table: np.ndarray, refcount: np.ndarray, blocks: int) -> np.ndarray:
    """``[S]`` pages each slot holds alone (refcount 1: freeing the slot returns them); table
    ids are local to each of the ``blocks`` blocks of ``refcount``."""
    s, n = table.shape[0], refcount.shape[0]
    off = (np.arange(s) // (s // blocks)) * (n // blocks)
    ids = np.where(table >= 0, table + off[:, None], 0)
    return ((table >= 0) & (refcount[ids] == 1)).sum(axis=1).astype(np.int64)


def host_page_view(cache: PagedKVCache) -> dict[str, np.ndarray]:
    """This host's pages as the on-demand allocator reads them: ``held``, ``private`` and
    ``cached`` (positions written) ``[S_host]``, ``free [blocks]`` (``host_blocks``)."""
    blocks = host_blocks(cache)
    if _split(cache) is None:
        table, refcount = np.asarray(cache.pages.page_table), np.asarray(cache.pages.refcount)
        cached = np.asarray(cache.pages.slot_len)
    else:
        table, refcount = (global_to_host(cache.pages.page_table),
                           global_to_host(cache.pages.refcount))
        cached = global_to_host(cache.pages.slot_len)
    return {"held": (table >= 0).sum(axis=1).astype(np.int64),
            "private": private_pages(table, refcount, blocks), "cached": cached,
            "free": (refcount == 0).reshape(blocks, -1).sum(axis=1).astype(np.int64)}


def admission_room(cache: Cache, live: np.ndarray, position: np.ndarray, window: int
                   ) -> np.ndarray:
    """Free pages left for fresh prompts in each of this host's page blocks (``[blocks]``,
    ``host_blocks``) once every live slot has room for its next window; slot ``r`` of the
    host's ``[S_host]`` rows draws from block ``r // (S_host / blocks)``. A large number for
    a dense cache (no page budget)."""
    if not is_paged(cache):
        return np.full(1, np.iinfo(np.int32).max, np.int64)
    held, refcount = host_pages(cache)
    return block_room(held, refcount, host_blocks(cache), np.asarray(live, bool), position,
                      window, cache.pages.page_size)
