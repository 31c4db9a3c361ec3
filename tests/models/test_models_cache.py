"""KV-cache decoding equals the full forward (ragged prompts, prefill + token-by-token)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tppo_jax.models.cache import DenseKVCache, KVCache
from tppo_jax.models.transformer import ModelConfig, Transformer

V = 64
# Jitted once per module: compiling beats eager op-by-op dispatch for these tiny models.
step = nnx.jit(lambda m, t, p, c, v: m.forward_with_cache(t, p, c, valid=v))
fwd = nnx.jit(lambda m, t: m(t))


@pytest.fixture(scope="module")
def model():
    cfg = ModelConfig.tiny(vocab_size=V, num_layers=2, tie_embeddings=False)
    return Transformer(cfg, rngs=nnx.Rngs(0))


def test_dense_cache_is_a_kvcache_and_pytree():
    cache = DenseKVCache.init(2, 3, 8, 2, 4)
    assert isinstance(cache, KVCache)
    leaves = jax.tree.leaves(cache)
    assert len(leaves) == 3 and cache.max_len == 8
    assert int(cache.reset_rows(jnp.array([True, False, True])).lengths.sum()) == 0


@pytest.mark.slow  # ~7 s in one process on 2 shared cores
def test_prefill_then_decode_matches_full_forward(model):
    b, total, p_bucket, steps = 3, 14, 8, 6
    seqs = jax.random.randint(jax.random.key(2), (b, total), 0, V)
    prompt_len = jnp.array([8, 3, 5])  # ragged, right padded inside the prefill bucket
    cache = model.init_cache(b, 16)
    pos = jnp.broadcast_to(jnp.arange(p_bucket)[None], (b, p_bucket))
    valid = pos < prompt_len[:, None]
    logits, cache = step(model, seqs[:, :p_bucket], pos, cache, valid)
    np.testing.assert_array_equal(cache.lengths, prompt_len)

    full = fwd(model, seqs)  # every row's sequence is seqs[b, :prompt_len + steps]
    for i in range(b):
        n = int(prompt_len[i])
        np.testing.assert_allclose(logits[i, :n], full[i, :n], atol=1e-5)

    cur = prompt_len
    for _ in range(steps):
        tok = jnp.take_along_axis(seqs, cur[:, None], axis=1)
        logits, cache = step(model, tok, cur[:, None], cache, jnp.ones((b, 1), bool))
        want = jnp.take_along_axis(full, cur[:, None, None], axis=1)
        np.testing.assert_allclose(logits, want, atol=1e-5)
        cur = cur + 1
    np.testing.assert_array_equal(cache.lengths, prompt_len + steps)


def test_invalid_tokens_are_not_written(model):
    cache = model.init_cache(1, 4)
    tok = jnp.array([[5, 6]])
    _, new = step(model, tok, jnp.array([[0, 1]]), cache, jnp.array([[True, False]]))
    assert int(new.lengths[0]) == 1
    assert np.abs(np.asarray(new.k[:, 0, 1:])).max() == 0
    assert np.abs(np.asarray(new.k[:, 0, 0])).max() > 0


def test_chunked_prefill_continues_a_cached_prefix(model):
    # T-PPO continuations: a kept prefix is extended by a new multi-token chunk whose
    # positions start at each row's own cached length.
    seqs = jax.random.randint(jax.random.key(7), (2, 12), 0, V)
    full = fwd(model, seqs)
    first = jnp.array([4, 6])
    pos = jnp.broadcast_to(jnp.arange(6)[None], (2, 6))
    _, cache = step(model, seqs[:, :6], pos, model.init_cache(2, 12), pos < first[:, None])
    pos2 = first[:, None] + jnp.arange(5)[None]
    tok2 = jnp.take_along_axis(seqs, pos2, axis=1)
    logits, cache = step(model, tok2, pos2, cache, jnp.ones((2, 5), bool))
    want = jnp.take_along_axis(full, pos2[..., None], axis=1)
    np.testing.assert_allclose(logits, want, atol=1e-5)
    np.testing.assert_array_equal(cache.lengths, first + 5)
