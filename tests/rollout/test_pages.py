"""Paged KV-cache bookkeeping: unit tests and hypothesis property tests over op sequences."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tppo_jax.rollout import pages

N, S, M, PS = 8, 5, 4, 4  # pages, slots, max pages per slot, page size


def check_invariants(state: pages.PageState) -> None:
    table = np.asarray(state.page_table)
    rc = np.asarray(state.refcount)
    lens = np.asarray(state.slot_len)
    counts = np.bincount(table[table >= 0], minlength=state.num_pages)
    np.testing.assert_array_equal(rc, counts, err_msg="refcount != table references")
    held = (table >= 0).sum(1)
    for s in range(state.num_slots):
        assert (table[s, : held[s]] >= 0).all(), "a slot's pages must be a prefix of its row"
        assert len(set(table[s, : held[s]])) == held[s], "duplicate page within a slot"
    assert (lens <= held * state.page_size).all(), "slot_len beyond reserved capacity"
    # Shared pages must be full in every holder, so no holder ever writes into them.
    for s in range(state.num_slots):
        for c in range(held[s]):
            if rc[table[s, c]] > 1:
                assert c < lens[s] // state.page_size, "shared page is not full"


def slot_contents(k_pages: jax.Array, state: pages.PageState, s: int) -> list[float]:
    table = np.asarray(state.page_table)[s]
    n = int(state.slot_len[s])
    kp = np.asarray(k_pages)[0, :, :, 0]
    return [float(kp[table[p // PS], p % PS]) for p in range(n)]


def test_init_and_simple_allocate_free():
    st0 = pages.init(N, S, M, PS)
    assert int(pages.num_free_pages(st0)) == N
    mask = jnp.array([True, False, True, False, False])
    st1, ok = pages.allocate(st0, mask, jnp.array([5, 0, 4, 0, 0]))
    assert ok.all()
    np.testing.assert_array_equal(st1.slot_len, [5, 0, 4, 0, 0])
    np.testing.assert_array_equal(pages.pages_held(st1), [2, 0, 1, 0, 0])
    assert int(pages.num_free_pages(st1)) == N - 3
    check_invariants(st1)
    st2 = pages.free(st1, jnp.ones(S, bool))
    assert int(pages.num_free_pages(st2)) == N
    check_invariants(st2)


def test_allocation_failure_does_not_overwrite():
    st0 = pages.init(4, 3, 4, PS)
    # Slot 0 wants 3 pages, slot 1 wants 2: only slot 0 fits; slot 2 exceeds the table.
    st1, ok = pages.allocate(st0, jnp.array([True, True, True]), jnp.array([12, 8, 17]))
    np.testing.assert_array_equal(ok, [True, False, False])
    np.testing.assert_array_equal(st1.slot_len, [12, 0, 0])
    np.testing.assert_array_equal(pages.pages_held(st1), [3, 0, 0])
    check_invariants(st1)
    # Nothing left for a 2-page request; existing pages untouched.
    st2, ok = pages.allocate(st1, jnp.array([False, True, False]), 8)
    assert not bool(ok[1])
    np.testing.assert_array_equal(st2.page_table, st1.page_table)


def test_share_prefix_partial_tail_and_write_guard():
    st0 = pages.init(N, S, M, PS)
    st1, _ = pages.allocate(st0, pages.slots_to_mask([0], S), 6)  # 1 full page + 2-token tail
    kp = jnp.zeros((1, N, PS, 1))
    vals = jnp.arange(1.0, 7.0)[None, :, None, None]
    pos = jnp.arange(6)[None]
    kp, _ = pages.write_kv(kp, kp, st1, jnp.array([0]), pos, vals, vals)
    dst = pages.slots_to_mask([1, 2, 3], S)
    st2, ok, tsrc, tdst = pages.share_prefix(st1, 0, dst)
    assert ok.all()
    check_invariants(st2)
    full_page = int(st1.page_table[0, 0])
    assert int(st2.refcount[full_page]) == 4  # src + 3 samples share the full page
    assert (np.asarray(tdst)[[1, 2, 3]] >= 0).all() and int(tdst[0]) == -1
    kp, _ = pages.copy_pages(kp, kp, tsrc, tdst)
    for s in range(4):
        assert slot_contents(kp, st2, s) == [1, 2, 3, 4, 5, 6]
    # A bogus write into the shared prompt page is dropped, the tail page is private.
    bad = jnp.full((1, 2, 1, 1), 99.0)
    kp2, _ = pages.write_kv(kp, kp, st2, jnp.array([2]), jnp.array([[1, 5]]), bad, bad)
    assert slot_contents(kp2, st2, 0) == [1, 2, 3, 4, 5, 6]
    assert slot_contents(kp2, st2, 2) == [1, 2, 3, 4, 5, 99]
    # Reprefill may rewrite the shared prompt page explicitly; every holder then sees it.
    kp3, _ = pages.write_kv(
        kp2, kp2, st2, jnp.array([0]), jnp.array([[1]]), bad[:, :1], bad[:, :1], allow_shared=True
    )
    assert all(slot_contents(kp3, st2, s)[1] == 99 for s in range(4))
    # Freeing the source keeps the shared page alive for the samples.
    st3 = pages.free(st2, pages.slots_to_mask([0], S))
    assert int(st3.refcount[full_page]) == 3
    assert slot_contents(kp2, st3, 1) == [1, 2, 3, 4, 5, 6]
    st4 = pages.free(st3, jnp.ones(S, bool))
    assert int(pages.num_free_pages(st4)) == N


def test_share_prefix_rejects_nonempty_and_short_pool():
    st0 = pages.init(3, 4, 3, PS)
    st1, _ = pages.allocate(st0, pages.slots_to_mask([0, 1], 4), jnp.array([5, 1, 0, 0]))
    # 3 pages: slot0 has 2, slot1 has 1 -> 0 free; slot 1 non-empty; slots 2,3 need tail pages.
    st2, ok, _, tdst = pages.share_prefix(st1, 0, pages.slots_to_mask([1, 2, 3], 4))
    np.testing.assert_array_equal(ok, [True, False, False, False])
    np.testing.assert_array_equal(st2.refcount, st1.refcount)
    assert (np.asarray(tdst) == -1).all()


def test_host_helpers():
    np.testing.assert_array_equal(pages.pages_needed(jnp.array([0, 1, 4, 5]), 4), [0, 1, 1, 2])


def test_attention_inputs_and_jit():
    st0 = pages.init(N, S, M, PS)
    st1, ok = jax.jit(pages.allocate)(st0, pages.slots_to_mask([1], S), 7)
    table, lens = pages.attention_inputs(st1, jnp.array([1, 0]))
    assert (np.asarray(table) >= 0).all()
    np.testing.assert_array_equal(lens, [7, 0])


# ------------------------------------------------------------------ property tests

_alloc = jax.jit(pages.allocate)
_free = jax.jit(pages.free)
_share = jax.jit(pages.share_prefix)
_write = jax.jit(pages.write_kv)
_copy = jax.jit(pages.copy_pages)

mask_st = st.lists(st.booleans(), min_size=S, max_size=S)
op_st = st.one_of(
    st.tuples(st.just("extend"), mask_st, st.lists(st.integers(0, 8), min_size=S, max_size=S)),
    st.tuples(st.just("share"), st.integers(0, S - 1), mask_st),
    st.tuples(st.just("free"), mask_st),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(op_st, min_size=1, max_size=12))
def test_random_op_sequences_keep_invariants(ops):
    state = pages.init(N, S, M, PS)
    kp = jnp.zeros((1, N, PS, 1))
    expect: list[list[float]] = [[] for _ in range(S)]
    counter = 1.0
    for op in ops:
        before_rc = np.asarray(state.refcount)
        before_table = np.asarray(state.page_table)
        if op[0] == "extend":
            mask, ntok = jnp.array(op[1]), jnp.array(op[2], jnp.int32)
            old_len = np.asarray(state.slot_len)
            free_before = int(pages.num_free_pages(state))
            state, ok = _alloc(state, mask, ntok)
            ok = np.asarray(ok)
            need = np.asarray(
                pages.extra_pages_needed(
                    pages.PageState(
                        jnp.asarray(before_table), jnp.asarray(before_rc), jnp.asarray(old_len), PS
                    ),
                    mask,
                    ntok,
                )
            )
            # Failures happen only for lack of table room or pages (served in slot order).
            m = np.array(op[1])
            assert sum(need[ok & m]) <= free_before
            fits = -(-(old_len + np.array(op[2])) // PS) <= M
            demand = np.cumsum(np.where(m & fits, need, 0))  # in-order page demand
            for s in np.flatnonzero(m):
                should = fits[s] and (need[s] == 0 or demand[s] <= free_before)
                assert ok[s] == should, (s, need, demand, free_before)
                if not ok[s]:
                    assert (np.asarray(state.page_table)[s] == before_table[s]).all()
            T = 9
            pos = old_len[:, None] + np.arange(T)[None]
            admitted = np.array(op[1]) & ok
            valid = (np.arange(T)[None] < np.asarray(ntok)[:, None]) & admitted[:, None]
            vals = counter + np.arange(S * T, dtype=np.float32).reshape(S, T)
            counter += S * T
            kv = jnp.asarray(vals)[:, :, None, None]
            kp, _ = _write(kp, kp, state, jnp.arange(S), pos, kv, kv, jnp.asarray(valid))
            for s in range(S):
                expect[s] += [float(x) for x in vals[s][valid[s]]]
        elif op[0] == "share":
            src, mask = op[1], jnp.array(op[2])
            state, ok, tsrc, tdst = _share(state, src, mask)
            kp, _ = _copy(kp, kp, tsrc, tdst)
            ok = np.asarray(ok)
            for s in range(S):
                if op[2][s] and ok[s]:
                    expect[s] = list(expect[src])
        else:
            state = _free(state, jnp.array(op[1]))
            for s in range(S):
                if op[1][s]:
                    expect[s] = []
        check_invariants(state)
        # Newly handed-out pages must have been free before this op.
        table = np.asarray(state.page_table)
        new = (table >= 0) & (table != before_table)
        if op[0] == "share":  # the source's shared pages are legitimately live
            new &= ~np.isin(table, before_table[op[1]])
        assert (before_rc[table[new]] == 0).all(), "a live page was handed out again"
        for s in range(S):
            assert slot_contents(kp, state, s) == expect[s], f"slot {s} contents corrupted"
    state = _free(state, jnp.ones(S, bool))
    assert int(pages.num_free_pages(state)) == N
    assert (np.asarray(state.page_table) == -1).all()
