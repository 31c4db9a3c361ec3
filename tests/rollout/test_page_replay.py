"""The scheduler's host-side page rules (``kv_slots.admit_rows`` / ``window_room`` /
``preempt_rows``) by hand, and the pod-scale page replay (``benchmarks/page_replay.py``) on a
small pool: every sample decoded once, every page back at the end."""

import numpy as np

from tppo_jax.benchmarks.page_replay import Pool, simulate
from tppo_jax.rollout import kv_slots


def test_admit_rows_by_hand():
    # 2 blocks of 2 slots; block 0 has room for one request of 2 pages, block 1 for two.
    got, deferred = kv_slots.admit_rows(np.array([0, 1, 2, 3]), np.array([3, 5]), 2,
                                        lambda i: 2)
    assert got == [(0, 0), (2, 1), (3, 2)] and deferred == 1
    # A block that turns the head away takes nothing after it, even a smaller request.
    got, deferred = kv_slots.admit_rows(np.array([0, 1]), np.array([2]), 2,
                                        lambda i: [3, 1][i])
    assert got == [] and deferred == 1


def test_window_room_and_preempt_rows_by_hand():
    # Slot 0 live at 5 tokens holding 2 pages of 4: its next window of 4 needs 1 more page.
    room = kv_slots.window_room(np.array([4, 4]), np.array([2, 0, 0, 0]),
                                np.array([True, False, False, False]), np.array([5, 0, 0, 0]),
                                4, 4)
    np.testing.assert_array_equal(room, [3, 4])
    gain, age = np.array([1, 2, 5, 1]), np.array([0, 3, 1, 2])
    everyone = np.ones(4, bool)
    # Block 0 short of 3: its youngest (row 1, 2 pages) is not enough, then row 0.
    np.testing.assert_array_equal(
        kv_slots.preempt_rows(np.array([3, 0]), gain, everyone, age), [True, True, False, False])
    np.testing.assert_array_equal(
        kv_slots.preempt_rows(np.array([2, 1]), gain, everyone, age), [False, True, False, True])
    np.testing.assert_array_equal(  # only candidates are preempted
        kv_slots.preempt_rows(np.array([2, 0]), gain, np.array([True, False, True, True]), age),
        [True, False, False, False])


def test_replay_decodes_every_sample_once_and_returns_every_page():
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(np.log(48), 0.9, 64), 4, 192).astype(np.int64)
    pool = Pool(slots=16, blocks=2, page_size=4, num_pages=16 * 12, max_len=16 + 192)
    res = {a: simulate(lengths, pool, window=64, L=192, prompt=16, alloc=a, chunk=16,
                       reserve=0.05) for a in ("window", "demand")}
    # Whole-window reservation deadlocks this pool: a block's continuations hold every page
    # and each waits for a window's more (nothing is preempted); on demand finishes it.
    assert res["window"]["deadlocked"] and res["window"]["total"]["stalled"] > 0
    r = res["demand"]
    t = r["total"]
    assert not r["deadlocked"] and t["finished"] == t["admitted"] == len(lengths)
    assert t["useful_tokens"] == int(lengths.sum()) and r["pages_in_use_at_end"] == 0
    assert t["preempted"] > 0 and t["reprefill_tokens"] > 0
    # With room for every slot the two allocators decode the same tokens, nothing preempted.
    big = Pool(slots=16, blocks=2, page_size=4, num_pages=16 * 52, max_len=16 + 192)
    for a in ("window", "demand"):
        r = simulate(lengths, big, window=64, L=192, prompt=16, alloc=a, chunk=16)
        assert r["total"]["finished"] == len(lengths) and r["total"]["preempted"] == 0
        assert r["total"]["useful_tokens"] == int(lengths.sum()) and not r["deadlocked"]


def test_plan_chunk_by_hand():
    # One block of 4 slots, pages of 4 tokens, 1 page free. Rows 0-2 write 4 more tokens:
    # each crosses into a new page (3 pages, short 2); the youngest, row 2, gives back its page
    # and the one it would have taken. Row 3 (waiting, 4 cached) has no room to come back.
    age = np.arange(4)
    args = dict(free=np.array([1]), held=np.array([2, 2, 1, 0]), private=np.array([2, 2, 1, 0]),
                position=np.array([8, 8, 3, 4]), candidates=np.array([True, True, True, False]),
                rank=age, waiting=np.array([False, False, False, True]), age=age, page_size=4)
    run = np.array([True, True, True, False])
    preempt, readmit = kv_slots.plan_chunk(n=np.array([4, 4, 4, 4]), running=run, **args)
    np.testing.assert_array_equal(preempt, [False, False, True, False])
    assert not readmit.any()
    # Nothing left to run but the waiting row: the youngest row done with its window makes
    # room (2 pages for 4 cached + 4 more, 1 free), and the waiting row comes back.
    preempt, readmit = kv_slots.plan_chunk(n=np.array([0, 0, 0, 4]), running=~run & run,
                                           **args)
    np.testing.assert_array_equal(preempt, [False, False, True, False])
    np.testing.assert_array_equal(readmit, [False, False, False, True])
