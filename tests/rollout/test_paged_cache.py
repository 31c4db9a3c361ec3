"""PagedKVCache == DenseKVCache == full forward; shared prompt pages decode like private ones."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tppo_jax.models.cache import KVCache
from tppo_jax.models.transformer import ModelConfig, Transformer
from tppo_jax.rollout import pages as pg
from tppo_jax.rollout.paged_cache import PagedKVCache, init_pools

V, PS = 64, 4
step = nnx.jit(lambda m, t, p, c, v: m.forward_with_cache(t, p, c, valid=v))


@nnx.jit
def prefill(model, pages, k, v, tokens, num_tokens, slots):
    """Reserves pages for ``tokens[:, :num_tokens]`` of each row in its empty slot and writes
    them; returns ``(pages, k, v, logits [B, T, V], ok [B])``."""
    b, t = tokens.shape
    mask = pg.slots_to_mask(slots, pages.num_slots)
    per_slot = jnp.zeros((pages.num_slots,), jnp.int32).at[slots].set(num_tokens)
    pages, ok_slot = pg.reserve(pages, mask, per_slot)
    ok = ok_slot[slots]
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None], (b, t))
    valid = (positions < num_tokens[:, None]) & ok[:, None]
    logits, cache = model.forward_with_cache(tokens, positions,
                                             PagedKVCache(pages, k, v, slots), valid=valid)
    return cache.pages, cache.k, cache.v, logits, ok
fwd = nnx.jit(lambda m, t, a: m(t, attention_mask=a))
reserve = jax.jit(pg.reserve)


@pytest.fixture(scope="module")
def model():
    cfg = ModelConfig.tiny(vocab_size=V, num_layers=2, tie_embeddings=False)
    return Transformer(cfg, rngs=nnx.Rngs(0))


def _pool(model, num_slots: int, num_pages: int = 48, max_pages: int = 5):
    c = model.config
    k, v = init_pools(c.num_layers, c.num_kv_heads, num_pages, PS, c.head_dim)
    return pg.init(num_pages, num_slots, max_pages, PS), k, v


def _decode_one(model, state, k, v, tok, pos, valid, slots):
    """One T=1 step for every row: reserve a page if needed, then forward."""
    mask = pg.slots_to_mask(jnp.where(valid, slots, -1), state.num_slots)
    state, ok = reserve(state, mask, 1)
    assert bool(ok.all())
    cache = PagedKVCache(state, k, v, slots)
    logits, cache = step(model, tok[:, None], pos[:, None], cache, valid[:, None])
    return cache.pages, cache.k, cache.v, logits[:, 0]


@pytest.mark.slow  # ~10 s in one process on 2 shared cores
def test_paged_matches_dense_and_full_forward_ragged(model):
    rng = np.random.default_rng(0)
    prompt = np.array([5, 9, 3])
    total = np.array([10, 14, 7])
    b, s = 3, int(total.max())
    tokens = rng.integers(1, V, size=(b, s)).astype(np.int32)
    amask = np.arange(s)[None] < total[:, None]
    tokens = np.where(amask, tokens, 0)
    full = np.asarray(fwd(model, jnp.asarray(tokens), jnp.asarray(amask)))

    state, k, v = _pool(model, num_slots=4)
    assert isinstance(PagedKVCache(state, k, v, jnp.arange(b)), KVCache)
    slots = jnp.array([2, 0, 3], jnp.int32)  # rows need not map to slots in order
    dense = model.init_cache(b, s)
    ptoks = jnp.asarray(np.where(np.arange(s)[None] < prompt[:, None], tokens, 0))
    state, k, v, plog, ok = prefill(model, state, k, v, ptoks, jnp.asarray(prompt), slots)
    assert bool(ok.all())
    pos = jnp.broadcast_to(jnp.arange(s)[None], (b, s))
    dlog, dense = step(model, ptoks, pos, dense, pos < jnp.asarray(prompt)[:, None])
    for r in range(b):
        n = prompt[r]
        np.testing.assert_allclose(np.asarray(plog)[r, :n], full[r, :n], atol=2e-5)
        np.testing.assert_allclose(np.asarray(dlog)[r, :n], full[r, :n], atol=2e-5)
    np.testing.assert_array_equal(np.asarray(state.slot_len)[np.asarray(slots)], prompt)

    for t in range(int(prompt.min()), s):
        valid = jnp.asarray((t >= prompt) & (t < total))
        tok = jnp.asarray(tokens[:, t])
        p = jnp.full((b,), t, jnp.int32)
        state, k, v, lg = _decode_one(model, state, k, v, tok, p, valid, slots)
        dl, dense = step(model, tok[:, None], p[:, None], dense, valid[:, None])
        for r in np.flatnonzero(np.asarray(valid)):
            np.testing.assert_allclose(np.asarray(lg)[r], full[r, t], atol=2e-5)
            np.testing.assert_allclose(np.asarray(dl)[r, 0], np.asarray(lg)[r], atol=2e-5)
    np.testing.assert_array_equal(np.asarray(state.slot_len)[np.asarray(slots)], total)
    # Every held page belongs to exactly one slot (no sharing here).
    held = np.asarray(state.page_table)
    assert int(np.asarray(state.refcount).sum()) == int((held >= 0).sum())


@pytest.mark.parametrize("plen", [8, 10])  # page-aligned prompt, and one with a tail page
@pytest.mark.slow  # ~8 s in one process on 2 shared cores
def test_shared_prefix_decodes_like_separate_prefill(model, plen):
    g, new = 4, 6
    rng = np.random.default_rng(plen)
    prompt = rng.integers(1, V, size=plen).astype(np.int32)
    conts = rng.integers(1, V, size=(g, new)).astype(np.int32)

    # Shared: prefill the prompt once into slot 0, then share it with slots 1..G-1.
    state, k, v = _pool(model, num_slots=g)
    one = jnp.asarray(prompt[None])
    state, k, v, _, ok = prefill(model, state, k, v, one, jnp.array([plen]), jnp.array([0]))
    assert bool(ok.all())
    dst = pg.slots_to_mask(jnp.arange(1, g), g)
    state, ok, tsrc, tdst = pg.share_prefix(state, 0, dst)
    assert bool(ok.all())
    for layer in range(k.shape[0]):
        kl, vl = pg.copy_pages(k[layer], v[layer], tsrc, tdst)
        k, v = k.at[layer].set(kl), v.at[layer].set(vl)
    n_full = plen // PS
    rc = np.asarray(state.refcount)[np.asarray(state.page_table)[0, :n_full]]
    np.testing.assert_array_equal(rc, g)

    # Separate: G independent prefills of the same prompt.
    sep, ks, vs = _pool(model, num_slots=g)
    toks = jnp.asarray(np.tile(prompt, (g, 1)))
    sep, ks, vs, _, _ = prefill(model, sep, ks, vs, toks, jnp.full((g,), plen), jnp.arange(g))

    slots = jnp.arange(g, dtype=jnp.int32)
    allv = jnp.ones((g,), bool)
    for t in range(new):
        tok = jnp.asarray(conts[:, t])
        p = jnp.full((g,), plen + t, jnp.int32)
        state, k, v, a = _decode_one(model, state, k, v, tok, p, allv, slots)
        sep, ks, vs, b = _decode_one(model, sep, ks, vs, tok, p, allv, slots)
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5)
    # Shared pages were never written after sharing, and freeing returns the pool.
    used_shared = int(np.asarray(state.refcount).astype(bool).sum())
    used_sep = int(np.asarray(sep.refcount).astype(bool).sum())
    assert used_shared == used_sep - (g - 1) * n_full
    freed = pg.free(state, jnp.ones((g,), bool))
    assert int(pg.num_free_pages(freed)) == freed.num_pages
