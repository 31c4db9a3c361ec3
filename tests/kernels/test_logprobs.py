"""Chunked log-probs/entropy equal the naive full-logits computation (values and grads)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tppo_jax.kernels.logprobs import naive_token_logprobs, token_logprobs


def _inputs(b=2, t=37, h=16, v=50, seed=0):
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(k1, (b, t, h)), jax.random.normal(k2, (h, v)),
            jax.random.randint(k3, (b, t), 0, v))


@pytest.mark.parametrize("chunk,temp", [(8, 1.0), (37, 0.7), (100, 1.3), (1, 1.0)])
def test_values_match_naive(chunk, temp):
    h, w, tgt = _inputs()
    lp, ent = jax.jit(lambda *a: token_logprobs(*a, chunk_size=chunk, temperature=temp))(
        h, w, tgt)
    lp0, ent0 = naive_token_logprobs(h, w, tgt, temperature=temp)
    assert lp.shape == ent.shape == (2, 37)
    np.testing.assert_allclose(lp, lp0, atol=1e-5)
    np.testing.assert_allclose(ent, ent0, atol=1e-5, rtol=1e-4)
    assert np.all(np.asarray(ent) >= -1e-6) and np.all(np.asarray(lp) <= 1e-6)


def test_gradients_match_naive():
    h, w, tgt = _inputs()
    coef = jax.random.normal(jax.random.key(9), (2, 37))

    def loss(fn):
        def f(h, w):
            lp, ent = fn(h, w, tgt)
            return jnp.sum(coef * lp) + 0.1 * jnp.sum(ent)
        return f

    chunked = lambda h, w, t: token_logprobs(h, w, t, chunk_size=8)
    g = jax.jit(jax.grad(loss(chunked), argnums=(0, 1)))(h, w)
    g0 = jax.grad(loss(naive_token_logprobs), argnums=(0, 1))(h, w)
    for a, b in zip(g, g0, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)


def test_bf16_hidden():
    h, w, tgt = _inputs()
    lp, _ = token_logprobs(h.astype(jnp.bfloat16), w.astype(jnp.bfloat16), tgt, chunk_size=16)
    lp0, _ = naive_token_logprobs(h, w, tgt)
    assert lp.dtype == jnp.float32
    np.testing.assert_allclose(lp, lp0, atol=0.3)


def test_chunked_uses_less_memory():
    b, t, h, v = 4, 1024, 32, 4096
    hid = jax.ShapeDtypeStruct((b, t, h), jnp.float32)
    w = jax.ShapeDtypeStruct((h, v), jnp.float32)
    tgt = jax.ShapeDtypeStruct((b, t), jnp.int32)

    def temp_bytes(fn):
        g = jax.grad(lambda x, y, z: jnp.sum(fn(x, y, z)[0]), argnums=(0, 1))
        return jax.jit(g).lower(hid, w, tgt).compile().memory_analysis().temp_size_in_bytes

    naive = temp_bytes(naive_token_logprobs)
    chunked = temp_bytes(lambda x, y, z: token_logprobs(x, y, z, chunk_size=64))
    full_logits = b * t * v * 4
    assert naive >= full_logits
    assert chunked < full_logits / 3 and chunked < naive / 5, (chunked, naive)
