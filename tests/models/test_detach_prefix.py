"""``grad_from``: a forward whose first columns run without gradient (``algo.detach_prefix``)
has the full forward's values and the gradient of a prefix cached by a frozen copy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tppo_jax.models.transformer import ModelConfig, Transformer

V, B, T, P = 64, 3, 20, 12


def _model(**kw):
    return Transformer(ModelConfig.tiny(vocab_size=V, num_layers=2, **kw), rngs=nnx.Rngs(0))


def _tokens():
    return jax.random.randint(jax.random.key(1), (B, T), 0, V)


def _weights():
    """``[B, T - P, V]`` fixed weights of a linear loss on the suffix's logits."""
    return jax.random.normal(jax.random.key(2), (B, T - P, V))


@pytest.mark.slow  # ~5 s in one process on 2 shared cores
def test_values_equal_the_full_forward():
    """Every column's hidden state, padded rows included, is the full pass's."""
    m, tok = _model(), _tokens()
    attn = jnp.arange(T)[None] < jnp.array([T, 15, 9])[:, None]  # row 3 ends in the prefix
    full = nnx.jit(lambda m: m.hidden_states(tok, attention_mask=attn))(m)
    split = nnx.jit(lambda m: m.hidden_states(tok, attention_mask=attn, grad_from=P))(m)
    valid = np.asarray(attn)
    np.testing.assert_allclose(np.asarray(split)[valid], np.asarray(full)[valid], atol=2e-5)


def _split_loss(params, graphdef, tok):
    m = nnx.merge(graphdef, params)
    return jnp.sum(m.logits_from_hidden(m.hidden_states(tok, grad_from=P))[:, P:] * _weights())


def _cached_prefix_loss(params, graphdef, tok):
    """The reference: the prefix prefilled into a KV cache by a frozen copy of the params
    (the decode path), then the suffix through that cache with live params."""
    m = nnx.merge(graphdef, params)
    frozen = nnx.merge(graphdef, jax.lax.stop_gradient(params))
    pos = jnp.broadcast_to(jnp.arange(T)[None], (B, T))
    cache = frozen.init_cache(B, T)
    _, cache = frozen.forward_with_cache(tok[:, :P], pos[:, :P], cache,
                                         valid=jnp.ones((B, P), bool))
    logits, _ = m.forward_with_cache(tok[:, P:], pos[:, P:], cache,
                                     valid=jnp.ones((B, T - P), bool))
    return jnp.sum(logits * _weights())


def _full_loss(params, graphdef, tok):
    m = nnx.merge(graphdef, params)
    return jnp.sum(m(tok)[:, P:] * _weights())


@pytest.mark.parametrize("remat", [False, True])
@pytest.mark.slow  # ~11 s in one process on 2 shared cores
def test_gradient_is_that_of_a_frozen_cached_prefix(remat):
    gd, st = nnx.split(_model(remat=remat))
    params, tok = nnx.to_pure_dict(st), _tokens()
    g = {f.__name__: jax.jit(jax.grad(f), static_argnums=1)(params, gd, tok)
         for f in (_split_loss, _cached_prefix_loss, _full_loss)}
    split, ref, full = (jax.tree.leaves(g[k]) for k in
                        ("_split_loss", "_cached_prefix_loss", "_full_loss"))
    for a, b in zip(split, ref, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    # and it is not the full gradient: the path through the prefix's keys and values is gone
    diff = max(float(jnp.abs(a - b).max()) for a, b in zip(split, full, strict=True))
    assert diff > 1e-3


def test_grad_from_out_of_range():
    m, tok = _model(), _tokens()
    with pytest.raises(ValueError, match="grad_from"):
        m.hidden_states(tok, grad_from=T)

