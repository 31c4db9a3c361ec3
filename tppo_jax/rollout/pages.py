"""Paged KV-cache bookkeeping: a page pool with refcounts and a per-slot page table.

Everything here is a pure function of a `PageState` pytree with static shapes, so the whole
allocate / share / free cycle runs inside `jax.jit` without recompiling per step.

Layout (matches the paged-attention kernels in `tppo_jax.kernels.paged_attention`):
  k_pages, v_pages  [Hkv, num_pages, page_size, D]   the pool itself (owned by the engine)
  page_table        [num_slots, max_pages_per_slot]  int32, -1 = no page
  refcount          [num_pages]                      int32, 0 = free
  slot_len          [num_slots]                      int32, tokens stored in the slot

Invariants (property-tested in tests/rollout/test_pages.py):
  * refcount[p] == number of page_table entries equal to p; a page is free iff refcount == 0;
  * a page with refcount > 0 is never handed out again;
  * slot_len[s] <= (pages held by s) * page_size; a slot's pages are a prefix of its row;
  * freeing every slot returns the pool to all-free.

Prefix sharing (G samples of one prompt): only *full* prompt pages are shared (refcount += G).
A partially filled last prompt page is NOT shared: `share_prefix` gives every destination a
private fresh page for the tail and returns (src_page, dst_page) pairs that the engine copies
with `copy_pages` (an eager copy-on-write at share time). Why: decode then only ever writes to
private pages, so no write-time CoW check is needed inside the generate loop.

Allocation failure never overwrites: slots that do not fit are reported in `ok` and left
untouched. Slots are admitted in slot order (a prefix of the requesting slots by cumulative
page demand), so the host scheduler can admit fewer prompts deterministically.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import struct

Array = jax.Array


@struct.dataclass
class PageState:
    """Page pool + page table. Shapes: see module docstring. `page_size` is static."""

    page_table: Array  # [S, M] int32, -1 = none
    refcount: Array  # [N] int32
    slot_len: Array  # [S] int32
    page_size: int = struct.field(pytree_node=False)

    @property
    def num_pages(self) -> int:
        return self.refcount.shape[0]

    @property
    def num_slots(self) -> int:
        return self.page_table.shape[0]

    @property
    def max_pages_per_slot(self) -> int:
        return self.page_table.shape[1]


def init(num_pages: int, num_slots: int, max_pages_per_slot: int, page_size: int) -> PageState:
    """An empty pool: every page free, every slot empty."""
    return PageState(
        page_table=jnp.full((num_slots, max_pages_per_slot), -1, jnp.int32),
        refcount=jnp.zeros((num_pages,), jnp.int32),
        slot_len=jnp.zeros((num_slots,), jnp.int32),
        page_size=page_size,
    )


def pages_needed(num_tokens: Array | int, page_size: int) -> Array:
    """ceil(num_tokens / page_size): pages to hold `num_tokens` tokens (elementwise)."""
    return (jnp.asarray(num_tokens, jnp.int32) + page_size - 1) // page_size


def num_free_pages(state: PageState) -> Array:
    """Scalar int32: pages with refcount 0."""
    return jnp.sum(state.refcount == 0).astype(jnp.int32)


def pages_held(state: PageState) -> Array:
    """[S] int32: table entries in use per slot (shared pages count for every holder)."""
    return jnp.sum(state.page_table >= 0, axis=1).astype(jnp.int32)


def slots_to_mask(slots: Array | Sequence[int], num_slots: int) -> Array:
    """[n] slot ids (-1 ignored) -> [num_slots] bool mask."""
    slots = jnp.asarray(slots, jnp.int32)
    safe = jnp.where(slots >= 0, slots, num_slots)  # -1 would wrap around; send it out of range
    return jnp.zeros((num_slots,), bool).at[safe].set(True, mode="drop")


def _free_page_list(state: PageState) -> Array:
    """[N] int32: ids of free pages in ascending order, padded with -1."""
    (ids,) = jnp.nonzero(state.refcount == 0, size=state.num_pages, fill_value=-1)
    return ids.astype(jnp.int32)


def extra_pages_needed(state: PageState, slot_mask: Array, num_tokens: Array | int) -> Array:
    """[S] int32: new pages each masked slot needs to store `num_tokens` more tokens."""
    want = pages_needed(state.slot_len + num_tokens, state.page_size)
    return jnp.where(slot_mask, jnp.maximum(want - pages_held(state), 0), 0)


def reserve(state: PageState, slot_mask: Array, num_tokens: Array | int) -> tuple[PageState, Array]:
    """Ensure each masked slot has room for `num_tokens` more tokens; slot_len is unchanged.

    Args:
      slot_mask: [S] bool, slots that request pages.
      num_tokens: scalar or [S] int, tokens to make room for beyond slot_len.
    Returns:
      (state, ok [S] bool). ok is True for unmasked slots and for masked slots that got their
      pages. A masked slot fails (state untouched for it) if it would exceed max_pages_per_slot,
      or if the pool runs out before it: slots are served in slot order and, among the slots
      that need new pages and fit the table, the admitted ones are a prefix (once one fails,
      every later one does too). Slots needing no new page always succeed.
    """
    slot_mask = jnp.asarray(slot_mask, bool)
    num_tokens = jnp.broadcast_to(jnp.asarray(num_tokens, jnp.int32), slot_mask.shape)
    held = pages_held(state)
    want = pages_needed(state.slot_len + num_tokens, state.page_size)
    fits_table = want <= state.max_pages_per_slot
    need = jnp.where(fits_table, extra_pages_needed(state, slot_mask, num_tokens), 0)
    end = jnp.cumsum(need)  # inclusive offsets into the free list
    # Zero-need slots always succeed; among the rest, admission is a prefix in slot order.
    admitted = slot_mask & fits_table & ((need == 0) | (end <= num_free_pages(state)))
    need = jnp.where(admitted, need, 0)
    start = jnp.cumsum(need) - need

    # Fill column c of slot s with free_list[start[s] + (c - held[s])] for the new columns.
    col = jnp.arange(state.max_pages_per_slot, dtype=jnp.int32)[None, :]
    j = col - held[:, None]
    new = (j >= 0) & (j < need[:, None])
    free_list = _free_page_list(state)
    picked = free_list[jnp.clip(start[:, None] + j, 0, state.num_pages - 1)]
    table = jnp.where(new, picked, state.page_table)
    # Scatter-add with -1 -> out-of-range index + mode="drop" so unused entries touch nothing.
    inc_idx = jnp.where(new, picked, state.num_pages)
    refcount = state.refcount.at[inc_idx.ravel()].add(1, mode="drop")
    ok = ~slot_mask | admitted
    return state.replace(page_table=table, refcount=refcount), ok


def advance(state: PageState, slot_mask: Array, num_tokens: Array | int) -> PageState:
    """slot_len += num_tokens on masked slots (capacity must already be reserved)."""
    add = jnp.where(jnp.asarray(slot_mask, bool), jnp.asarray(num_tokens, jnp.int32), 0)
    return state.replace(slot_len=state.slot_len + add)


def allocate(
    state: PageState, slot_mask: Array, num_tokens: Array | int
) -> tuple[PageState, Array]:
    """Extend masked slots by `num_tokens` tokens: `reserve` then `advance` the slots that fit.

    The new tokens occupy positions [old slot_len, old slot_len + num_tokens). Returns
    (state, ok [S] bool) with the same failure semantics as `reserve`.
    """
    state, ok = reserve(state, slot_mask, num_tokens)
    return advance(state, jnp.asarray(slot_mask, bool) & ok, num_tokens), ok


def free(state: PageState, slot_mask: Array) -> PageState:
    """Release every page of the masked slots (refcount -= 1) and empty them.

    Pages whose refcount reaches 0 are back in the pool; shared prompt pages stay live while
    any other sample still references them.
    """
    slot_mask = jnp.asarray(slot_mask, bool)
    drop = slot_mask[:, None] & (state.page_table >= 0)
    idx = jnp.where(drop, state.page_table, state.num_pages)
    refcount = state.refcount.at[idx.ravel()].add(-1, mode="drop")
    table = jnp.where(slot_mask[:, None], -1, state.page_table)
    slot_len = jnp.where(slot_mask, 0, state.slot_len)
    return state.replace(page_table=table, refcount=refcount, slot_len=slot_len)


def share_prefix(
    state: PageState, src_slot: Array | int, dst_mask: Array
) -> tuple[PageState, Array, Array, Array]:
    """Give empty `dst` slots the prompt held by `src_slot` (the G samples of one prompt).

    Full pages of src are shared (refcount += 1 per destination). If src's last page is only
    partly filled, each admitted destination gets a private fresh page for that tail; the
    caller must copy the tail's K/V with `copy_pages(k, v, tail_src, tail_dst)`.

    Args:
      src_slot: scalar int, slot holding the prefilled prompt (slot_len = prompt length).
      dst_mask: [S] bool, destination slots; each must be empty and differ from src.
    Returns:
      state, ok [S] bool (False for masked dst slots that were non-empty, == src, or could not
      get a tail page; those are untouched), tail_src [S] int32, tail_dst [S] int32 (page ids to
      copy, -1 where no copy is needed).
    """
    src_slot = jnp.asarray(src_slot, jnp.int32)
    dst_mask = jnp.asarray(dst_mask, bool)
    ps, S, M = state.page_size, state.num_slots, state.max_pages_per_slot
    src_len = state.slot_len[src_slot]
    src_row = state.page_table[src_slot]
    n_full = src_len // ps
    has_tail = src_len % ps != 0
    empty = (pages_held(state) == 0) & (state.slot_len == 0)
    valid = dst_mask & empty & (jnp.arange(S) != src_slot)
    # Admit destinations in order while a tail page per destination is available.
    need = jnp.where(valid & has_tail, 1, 0)
    admitted = valid & (jnp.cumsum(need) <= num_free_pages(state))

    col = jnp.arange(M, dtype=jnp.int32)
    shared_cols = col < n_full  # [M]
    share = admitted[:, None] & shared_cols[None, :]  # [S, M]
    table = jnp.where(share, src_row[None, :], state.page_table)
    n_admitted = jnp.sum(admitted).astype(jnp.int32)
    inc_idx = jnp.where(shared_cols, src_row, state.num_pages)
    refcount = state.refcount.at[inc_idx].add(n_admitted, mode="drop")
    slot_len = jnp.where(admitted, n_full * ps, state.slot_len)
    state = state.replace(page_table=table, refcount=refcount, slot_len=slot_len)

    # Private tail page per destination (cannot fail: admission counted it above).
    state, _ = allocate(state, admitted, jnp.where(has_tail, src_len - n_full * ps, 0))
    tail_col = jnp.minimum(n_full, M - 1)
    want_copy = admitted & has_tail
    tail_dst = jnp.where(want_copy, state.page_table[:, tail_col], -1)
    tail_src = jnp.where(want_copy, src_row[tail_col], -1)
    ok = ~dst_mask | admitted
    return state, ok, tail_src, tail_dst


def copy_pages(
    k_pages: Array, v_pages: Array, src_pages: Array, dst_pages: Array
) -> tuple[Array, Array]:
    """k/v_pages[:, dst] = k/v_pages[:, src] for each pair; pairs with dst == -1 are skipped.

    k_pages, v_pages: [Hkv, N, page_size, D]; src_pages, dst_pages: [n] int32.
    """
    n = k_pages.shape[1]
    dst = jnp.where(dst_pages >= 0, dst_pages, n)
    src = jnp.clip(src_pages, 0, n - 1)
    return (
        k_pages.at[:, dst].set(k_pages[:, src], mode="drop"),
        v_pages.at[:, dst].set(v_pages[:, src], mode="drop"),
    )


def write_kv(
    k_pages: Array,
    v_pages: Array,
    state: PageState,
    slots: Array,
    positions: Array,
    k: Array,
    v: Array,
    valid: Array | None = None,
    *,
    allow_shared: bool = False,
    layer: Array | int | None = None,
) -> tuple[Array, Array]:
    """Scatter new K/V into the pool at (slot, position).

    Args:
      k_pages, v_pages: [Hkv, N, page_size, D] pool arrays ([L, Hkv, N, page_size, D] with
        ``layer``).
      slots: [B] int32 slot of each row.
      positions: [B, T] int32 token positions within the slot (negative = padding).
      k, v: [B, T, Hkv, D] new keys / values.
      valid: optional [B, T] bool; False entries are not written.
      allow_shared: static; permit writes into shared pages. Only for `kv_policy: reprefill`,
        where the shared prompt is recomputed under new weights and every holder gets the same
        K/V (write it once, from one holder).
      layer: the layer to write in stacked pools (an int or an int32 scalar, traced under the
        decoder's layer scan); None for one layer's pools.
    Returns:
      Updated (k_pages, v_pages). Writes are dropped where the position has no page reserved,
      and (unless allow_shared) where the page is shared (refcount > 1): shared prompt pages
      are immutable, so a bad position can never corrupt another sample's prefix.
    """
    ps, n = state.page_size, state.num_pages
    positions = jnp.asarray(positions, jnp.int32)
    col = positions // ps
    in_range = (positions >= 0) & (col < state.max_pages_per_slot)
    page = state.page_table[slots[:, None], jnp.clip(col, 0, state.max_pages_per_slot - 1)]
    ok = in_range & (page >= 0)
    if not allow_shared:
        ok &= state.refcount[jnp.clip(page, 0, n - 1)] == 1
    if valid is not None:
        ok &= valid
    page = jnp.where(ok, page, n)  # out of range -> dropped
    off = positions % ps
    # [B, T, Hkv, D] -> [Hkv, B, T, D] to line up with k_pages[:, page, off].
    k_t = jnp.moveaxis(k, 2, 0).astype(k_pages.dtype)
    v_t = jnp.moveaxis(v, 2, 0).astype(v_pages.dtype)
    if layer is not None:
        # Stacked [L, Hkv, N, ps, D] pools, written in place. The int and the index arrays
        # are split by a slice, so the indexed view is [B, T, Hkv, D]: k as given.
        return (k_pages.at[layer, :, page, off].set(k.astype(k_pages.dtype), mode="drop"),
                v_pages.at[layer, :, page, off].set(v.astype(v_pages.dtype), mode="drop"))
    return (
        k_pages.at[:, page, off].set(k_t, mode="drop"),
        v_pages.at[:, page, off].set(v_t, mode="drop"),
    )


def attention_inputs(state: PageState, slots: Array) -> tuple[Array, Array]:
    """(page_table [B, M] with -1 -> 0, lengths [B]) for the paged-attention kernel.

    -1 entries are replaced by page 0 because the kernels index pages unconditionally; those
    positions lie beyond `lengths` and are masked.
    """
    table = state.page_table[slots]
    return jnp.maximum(table, 0), state.slot_len[slots]
