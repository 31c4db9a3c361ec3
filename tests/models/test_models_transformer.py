"""Decoder forward: shapes, causality, right padding, RoPE scaling, dtypes, value model."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tppo_jax.models.rope import apply_rope, rope_inv_freq
from tppo_jax.models.transformer import ModelConfig, Transformer

V = 64
# Jitted forward: tests compile once per shape instead of dispatching every op eagerly.
fwd = nnx.jit(lambda m, t, p=None, a=None: m(t, p, a))


@pytest.fixture(scope="module")
def model():
    return Transformer(ModelConfig.tiny(vocab_size=V, num_layers=2), rngs=nnx.Rngs(0))


def _tokens(b=2, t=12, seed=1):
    return jax.random.randint(jax.random.key(seed), (b, t), 0, V)


def test_tiny_preset_size_and_shapes(model):
    n = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    abstract = nnx.eval_shape(lambda: Transformer(ModelConfig.tiny(), rngs=nnx.Rngs(0)))
    full = sum(x.size for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
    assert 0.6e6 < full < 1.0e6, full
    assert n < full
    logits = fwd(model, _tokens())
    assert logits.shape == (2, 12, V) and logits.dtype == jnp.float32
    assert np.isfinite(np.asarray(logits)).all()


def test_hidden_states_and_head_compose(model):
    tok = _tokens()
    h = nnx.jit(lambda m, t: m.hidden_states(t))(model, tok)
    assert h.shape == (2, 12, 128)
    np.testing.assert_allclose(model.logits_from_hidden(h), fwd(model, tok), atol=1e-5)
    assert model.lm_head_weight().shape == (128, V)


def test_causal(model):
    tok = _tokens()
    tok2 = tok.at[:, 8:].set((tok[:, 8:] + 1) % V)
    a, b = fwd(model, tok), fwd(model, tok2)
    np.testing.assert_allclose(a[:, :8], b[:, :8], atol=1e-6)
    assert np.abs(np.asarray(a[:, 8:] - b[:, 8:])).max() > 1e-4


def test_right_padding_does_not_change_valid_logits(model):
    tok = _tokens(1, 7)
    padded = jnp.concatenate([tok, jnp.zeros((1, 5), tok.dtype)], axis=1)
    mask = jnp.array([[1] * 7 + [0] * 5])
    np.testing.assert_allclose(fwd(model, padded, None, mask)[:, :7], fwd(model, tok),
                               atol=1e-5)


def test_positions_only_shift_rope():
    # RoPE is relative: shifting every position by a constant leaves attention unchanged.
    cfg = ModelConfig.tiny(vocab_size=V, num_layers=2)
    m = Transformer(cfg, rngs=nnx.Rngs(3))
    tok = _tokens(1, 9)
    pos = jnp.arange(9)[None]
    np.testing.assert_allclose(fwd(m, tok, pos + 37), fwd(m, tok, pos), atol=1e-4)


@pytest.mark.parametrize("scaling", [
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
])
def test_rope_scaling(scaling):
    base = ModelConfig.tiny(vocab_size=V, num_layers=2)
    cfg = ModelConfig.tiny(vocab_size=V, rope_scaling=scaling)
    inv0, inv = np.asarray(rope_inv_freq(base)), np.asarray(rope_inv_freq(cfg))
    factor = scaling["factor"]
    if scaling["rope_type"] == "linear":
        np.testing.assert_allclose(inv, inv0 / factor, rtol=1e-6)
    else:
        assert inv[0] == inv0[0]  # highest frequency untouched
        np.testing.assert_allclose(inv[-1], inv0[-1] / factor, rtol=1e-6)
        assert np.all(inv <= inv0 + 1e-12) and np.all(inv >= inv0 / factor - 1e-12)
    assert cfg.rope_scaling_dict == scaling
    hash(cfg)  # hashable: usable as static metadata


def test_rope_is_rotation():
    x = jax.random.normal(jax.random.key(0), (1, 5, 2, 32))
    pos = jnp.arange(5)[None]
    y = apply_rope(x, pos, rope_inv_freq(ModelConfig.tiny()))
    np.testing.assert_allclose(jnp.linalg.norm(y, axis=-1), jnp.linalg.norm(x, axis=-1),
                               rtol=1e-5)


def test_untied_and_no_bias_and_bf16():
    cfg = ModelConfig.tiny(vocab_size=V, num_layers=2, tie_embeddings=False, qkv_bias=False,
                           dtype="bfloat16")
    m = Transformer(cfg, rngs=nnx.Rngs(0))
    assert m.lm_head[...].dtype == jnp.bfloat16 and not hasattr(m.backbone.layers.attn,
                                                                "q_bias")
    logits = fwd(m, _tokens())
    assert logits.dtype == jnp.float32 and np.isfinite(np.asarray(logits)).all()


def test_bad_config():
    with pytest.raises(ValueError, match="multiple"):
        ModelConfig.tiny(num_kv_heads=3)
    with pytest.raises(ValueError, match="remat_policy"):
        ModelConfig.tiny(remat_policy="everything")


@pytest.mark.slow  # ~7 s in one process on 2 shared cores
def test_remat_gives_same_gradients():
    cfg = ModelConfig.tiny(vocab_size=V, num_layers=1)
    tok = _tokens(2, 6)
    grads = []
    for remat, policy in ((False, "full"), (True, "full"), (True, "dots")):
        m = Transformer(dataclasses.replace(cfg, remat=remat, remat_policy=policy),
                        rngs=nnx.Rngs(0))
        g = nnx.jit(nnx.grad(lambda m: jnp.mean(m(tok) ** 2)))(m)
        grads.append(jax.tree.leaves(nnx.state(g)))
    for other in grads[1:]:
        for a, b in zip(grads[0], other, strict=True):
            np.testing.assert_allclose(a, b, atol=1e-6)


def layer_slice(layers: nnx.Module, i: int) -> nnx.Module:
    """Layer ``i`` of stacked ``layers`` as a module of its own (a copy)."""
    graphdef, state = nnx.split(layers)
    return nnx.merge(graphdef, jax.tree.map(lambda a: a[i], state))


def test_scanned_layers_equal_a_python_loop_over_the_layers_and_unroll():
    """The layer scan computes what applying each layer's slice in turn computes (logits,
    a cached prefill), with remat too; ``unroll_layers`` gives the same
    numbers with no loop in the program, and gradients agree to rounding (the scan's backward
    sums bias gradients in another order: ~1 ulp)."""
    from tppo_jax.kernels.attention import CausalMask

    cfg = ModelConfig.tiny(vocab_size=V, num_layers=3)
    m = Transformer(cfg, rngs=nnx.Rngs(5))
    tok = _tokens(2, 8)
    bb = m.backbone
    x = jnp.take(bb.embed[...], tok, axis=0)
    pos = jnp.broadcast_to(jnp.arange(8)[None], (2, 8))
    mask, inv = CausalMask.from_attention_mask(None), rope_inv_freq(cfg)
    for i in range(cfg.num_layers):
        x = layer_slice(bb.layers, i)(x, pos, mask, inv)
    want = m.logits_from_hidden(bb.final_norm(x))
    np.testing.assert_allclose(fwd(m, tok), want, rtol=1e-5, atol=1e-5)
    cache = m.init_cache(2, 8)
    cached, cache = nnx.jit(lambda m, t, p, c: m.forward_with_cache(t, p, c, valid=t >= 0))(
        m, tok, pos, cache)
    np.testing.assert_allclose(cached, want, rtol=1e-5, atol=1e-5)
    assert np.abs(np.asarray(cache.k[cfg.num_layers - 1])).max() > 0  # every layer wrote

    def loss(m):
        return jnp.mean(m.hidden_states(tok).astype(jnp.float32) ** 2)

    grads, texts = [], []
    for unroll in (False, True):
        for remat in (False, True):
            mu = Transformer(dataclasses.replace(cfg, unroll_layers=unroll, remat=remat),
                             rngs=nnx.Rngs(5))
            np.testing.assert_allclose(fwd(mu, tok), want, rtol=1e-5, atol=1e-5)
            grads.append(jax.tree.leaves(nnx.state(nnx.jit(nnx.grad(loss))(mu))))
        gd, st = nnx.split(mu)
        texts.append(jax.jit(lambda s, gd=gd: nnx.merge(gd, s)(tok)).lower(st).as_text())
    assert "while" in texts[0] and "while" not in texts[1]
    for other in grads[1:]:
        for a, b in zip(grads[0], other, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
