"""A paged pool split per batch shard (what several hosts run, ``paged_cache.PoolSplit``):
each block's slots take pages only from its own block (ids local to the block), admission
budgets per block, prompt sharing within a block, and decoding equal to one pool."""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from tppo_jax.models.transformer import ModelConfig, create_model
from tppo_jax.parallel.mesh import make_mesh
from tppo_jax.rollout import kv_slots
from tppo_jax.rollout.decode import SamplingParams
from tppo_jax.rollout.engine import DecodeEngine

CFG = ModelConfig.tiny(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=16)


def test_block_room_by_hand():
    # 2 blocks of 2 slots and 3 pages, page_size 4, window 4.
    held = np.array([2, 0, 1, 0])  # slot 0: pages 0, 1 of block 0; slot 2: page 0 of block 1
    refcount = np.array([1, 1, 0, 1, 0, 0])
    live = np.array([True, False, True, False])
    position = np.array([7, 0, 3, 0])
    # block 0: 1 free page; slot 0 needs ceil(11 / 4) = 3 pages, holds 2 -> room 0.
    # block 1: 2 free pages; slot 2 needs ceil(7 / 4) = 2, holds 1 -> room 1.
    room = kv_slots.block_room(held, refcount, 2, live, position, 4, 4)
    np.testing.assert_array_equal(room, [0, 1])
    # One block: the single-pool budget (3 free - 2 growing).
    np.testing.assert_array_equal(
        kv_slots.block_room(held, refcount, 1, live, position, 4, 4), [1])


@pytest.fixture(scope="module")
def mesh(devices8):
    return make_mesh({"fsdp": 4, "tensor": 2})  # 4 batch shards: 4 blocks


def test_blocks_reserve_and_free_their_own_pages(mesh):
    cache = kv_slots.new_cache(CFG, 8, 16, kind="paged", page_size=4, num_pages=8, mesh=mesh,
                               split_pages=True)
    assert cache.split.groups == 4 and kv_slots.is_split(cache)
    assert cache.k.sharding.spec == P(None, "tensor", ("data", "fsdp"), None, None)
    assert cache.pages.page_table.sharding.spec == P(("data", "fsdp"))
    rows = np.zeros(8, bool)
    rows[[0, 1, 2, 7]] = True
    upto = np.array([5, 5, 4, 0, 0, 0, 0, 8], np.int32)
    # Block 0 (slots 0, 1) has 2 pages: slot 0 takes both, slot 1 finds none. Block 1
    # (slots 2, 3): slot 2 takes its page 0. Block 3 (slots 6, 7): slot 7 takes pages 0, 1.
    cache, ok = kv_slots.reserve(cache, jax.numpy.asarray(rows), jax.numpy.asarray(upto))
    np.testing.assert_array_equal(np.asarray(ok), [1, 0, 1, 1, 1, 1, 1, 1])
    table = np.asarray(cache.pages.page_table)
    np.testing.assert_array_equal(table[:, :2], [[0, 1], [-1, -1], [0, -1], [-1, -1],
                                                 [-1, -1], [-1, -1], [-1, -1], [0, 1]])
    np.testing.assert_array_equal(np.asarray(cache.pages.refcount), [1, 1, 1, 0, 0, 0, 1, 1])
    assert kv_slots.pages_in_use(cache) == 5
    np.testing.assert_array_equal(kv_slots.host_pages(cache)[0], [2, 0, 1, 0, 0, 0, 0, 2])
    # Every block's budget: block 0 is full, block 2 untouched.
    room = kv_slots.admission_room(cache, np.zeros(8, bool), np.zeros(8, np.int32), 4)
    np.testing.assert_array_equal(room, [0, 1, 2, 0])
    cache = kv_slots.free(cache, jax.numpy.asarray(np.arange(8) == 0))
    np.testing.assert_array_equal(np.asarray(cache.pages.refcount), [0, 0, 1, 0, 0, 0, 1, 1])
    np.testing.assert_array_equal(
        kv_slots.admission_room(cache, np.zeros(8, bool), np.zeros(8, np.int32), 4),
        [2, 1, 2, 0])


def _prompts(b: int = 8, s: int = 24):
    rng = np.random.default_rng(0)
    tokens = rng.integers(4, 60, size=(b, s)).astype(np.int32)
    lens = rng.integers(3, 9, size=b).astype(np.int32)
    return tokens, lens


@pytest.mark.slow  # ~30 s on 2 shared cores
def test_split_pool_decodes_like_one_pool(mesh):
    tokens, lens = _prompts()
    greedy = SamplingParams(greedy=True)
    one = DecodeEngine(create_model(CFG, seed=0), eos_ids=(), max_slots=8,
                       max_target_length=24, kv_cache="paged", page_size=4, sampling=greedy)
    want = one.decode_prompts(one.load_params(), tokens, lens, 12)
    model = create_model(CFG, seed=0, mesh=mesh)
    split = DecodeEngine(model, eos_ids=(), max_slots=8, max_target_length=24,
                         kv_cache="paged", page_size=4, sampling=greedy, mesh=mesh)
    params = split.load_params()
    got = split.decode_prompts(params, tokens, lens, 12)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    np.testing.assert_allclose(np.asarray(got.logprobs), np.asarray(want.logprobs), atol=1e-5)

    # Sharing within blocks, one prompt per block per call: slot 0's prompt to slot 1
    # (block 0), slot 4's to slot 5 (block 2); slot 3 (block 1 has no source) is refused.
    ds, _ = split.prefill_prompts(params, tokens, lens)
    src, dst = np.zeros(8, bool), np.zeros(8, bool)
    src[[0, 4]] = True
    dst[[1, 3, 5]] = True
    put = split.put_rows
    ds, ok = split.share_prompts(ds, put(src), put(dst), put(np.arange(8, dtype=np.uint32)))
    np.testing.assert_array_equal(np.asarray(ok), [1, 1, 1, 0, 1, 1, 1, 1])
    table = np.asarray(ds.cache.pages.page_table)
    full = (lens[[0, 4]] - 1) // 4  # full prompt pages shared by reference
    np.testing.assert_array_equal(table[1, :full[0]], table[0, :full[0]])
    np.testing.assert_array_equal(table[5, :full[1]], table[4, :full[1]])
    ds, out = split.generate_window(ds, params, 6)
    toks = np.asarray(out.tokens)
    np.testing.assert_array_equal(toks[1], toks[0])  # greedy: the same prompt, the same text
    np.testing.assert_array_equal(toks[5], toks[4])
    assert not np.asarray(ds.live)[3]  # refused: emptied, nothing decoded
    assert int(np.asarray(out.count)[3]) == 0


@pytest.mark.slow  # ~15 s on 2 shared cores (3 split-pool compiles)
def test_gathered_prefill_writes_what_the_all_slots_prefill_writes(mesh):
    """``prefill_gathered`` of one row per block (slots 1, 2 and 7; block 2 padding) into a
    split pool already holding slots 0 and 3: the same pages, page table, refcounts, cached
    KV, pending tokens and positions as ``prefill_slots`` over all 8 slots with those rows
    selected; a row whose block has no page left is refused in both."""
    tokens, lens = _prompts()
    eng = DecodeEngine(create_model(CFG, seed=0, mesh=mesh), eos_ids=(), max_slots=8,
                       max_target_length=24, kv_cache="paged", page_size=4, num_pages=12,
                       mesh=mesh, reprefill_tokens=8)
    assert eng.page_blocks == 4 and eng.gather_rows(8) == 1
    params, put = eng.load_params(), eng.put_rows
    lens[[0, 3]] = 8  # block 1 (3 pages): slot 3 holds 2 pages and slot 2 needs 2: refused
    mask = lambda rows: put(np.isin(np.arange(8), rows))  # noqa: E731
    states = []
    for _ in range(2):
        ds = eng.init_decode_state()
        ds, _ = eng.prefill_slots(params, ds, put(tokens), put(lens), mask([0, 3]))
        states.append(ds)
    want, ok = eng.prefill_slots(params, states[0], put(tokens), put(lens), mask([1, 2, 7]))
    slots = np.array([1, 2, 4, 7], np.int32)
    got, got_ok = eng.prefill_gathered(params, states[1], put(tokens[slots]),
                                       put(lens[slots]), put(slots),
                                       put(np.array([1, 1, 0, 1], bool)))
    np.testing.assert_array_equal(np.asarray(got_ok), [1, 0, 0, 1])
    np.testing.assert_array_equal(np.asarray(ok)[[1, 2, 7]], [1, 0, 1])
    for a, b in [(got.next_token, want.next_token), (got.position, want.position),
                 (got.cache.pages.page_table, want.cache.pages.page_table),
                 (got.cache.pages.refcount, want.cache.pages.refcount),
                 (got.cache.pages.slot_len, want.cache.pages.slot_len),
                 (got.cache.slots, want.cache.slots)]:
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert np.asarray(want.cache.pages.slot_len)[[1, 7]].tolist() == (lens[[1, 7]] - 1).tolist()
    np.testing.assert_allclose(np.asarray(got.cache.k), np.asarray(want.cache.k), atol=1e-6)
    np.testing.assert_allclose(np.asarray(got.cache.v), np.asarray(want.cache.v), atol=1e-6)
