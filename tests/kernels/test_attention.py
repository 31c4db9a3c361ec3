"""The training forward's attention implementations against the dense path."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh

from tppo_jax.kernels.attention import (
    CausalMask,
    attention,
    attention_mesh,
    resolve_impl,
    traced_on,
)
from tppo_jax.models.transformer import ModelConfig, Transformer
from tppo_jax.parallel.mesh import make_mesh

# (batch, queries, keys, q heads, kv heads, head dim, block, real keys per row or None)
CASES = [
    (2, 13, 13, 4, 2, 8, 4, (10, 13)),    # right padding, uneven last block
    (3, 16, 16, 6, 2, 8, 5, (16, 1, 0)),  # GQA 3:1, one real key, an all-padding row
    (1, 9, 9, 2, 2, 16, 16, None),        # one block larger than the sequence
    (2, 7, 19, 4, 1, 8, 6, (19, 15)),     # queries 12..18 of 19 keys (a continuation)
]


def _inputs(case, dtype=jnp.float32):
    b, t, s, hq, hkv, d, _, real = case
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(t * s + hq), 3)
    q = jax.random.normal(kq, (b, t, hq, d), dtype)
    k = jax.random.normal(kk, (b, s, hkv, d), dtype)
    v = jax.random.normal(kv, (b, s, hkv, d), dtype)
    am = None if real is None else jnp.arange(s)[None, :] < jnp.asarray(real)[:, None]
    return q, k, v, CausalMask.from_attention_mask(am, q_offset=s - t)


def _grads(impl, mask, q, k, v, **kw):
    """Gradients wrt ``q, k, v`` of a loss with its own cotangent for every output element."""
    def loss(q, k, v, mask):
        return jnp.sum(jnp.sin(attention(q, k, v, mask, impl, **kw)))

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v, mask)


@pytest.mark.parametrize("case", CASES)
def test_chunked_equals_dense_values_and_gradients(case):
    q, k, v, mask = _inputs(case)
    block = case[6]
    dense = attention(q, k, v, mask, "dense")
    chunked = attention(q, k, v, mask, "chunked", block_size=block)
    np.testing.assert_allclose(chunked, dense, rtol=1e-5, atol=1e-5)
    g_dense = _grads("dense", mask, q, k, v)
    g_chunk = _grads("chunked", mask, q, k, v, block_size=block)
    for name, a, b in zip("qkv", g_chunk, g_dense, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=f"d{name}")


def test_chunked_bf16_stays_close_to_dense():
    q, k, v, mask = _inputs(CASES[0], jnp.bfloat16)
    dense = attention(q, k, v, mask, "dense").astype(jnp.float32)
    chunked = attention(q, k, v, mask, "chunked", block_size=4).astype(jnp.float32)
    assert chunked.dtype == jnp.float32 and float(jnp.max(jnp.abs(chunked - dense))) < 3e-2


def test_auto_on_cpu_is_the_dense_path_bit_for_bit_for_short_sequences():
    q, k, v, mask = _inputs(CASES[0])
    assert resolve_impl("auto", q, k, mask, platform="cpu") == "dense"
    np.testing.assert_array_equal(attention(q, k, v, mask, "auto"),
                                  attention(q, k, v, mask, "dense"))
    long_q = jax.ShapeDtypeStruct((1, 2048, 2, 8), jnp.float32)
    assert resolve_impl("auto", long_q, long_q, mask, platform="cpu") == "chunked"
    assert resolve_impl("auto", q, k, mask, platform="tpu") == "chunked"  # no program mesh
    with attention_mesh(make_mesh({"data": 1}, devices=jax.devices()[:1])):
        assert resolve_impl("auto", q, k, mask, platform="tpu") == "splash"  # one device
    with attention_mesh(Mesh(np.asarray(jax.devices()[:2]), ("x",))):
        # two devices not on the project's axes: splash could not be partitioned
        assert resolve_impl("auto", q, k, mask, platform="tpu") == "chunked"
        assert resolve_impl("splash", q, k, mask, platform="tpu") == "chunked"
    with jax.set_mesh(make_mesh({"data": 1}, devices=jax.devices()[:1])):
        # jax's mesh context is not how kernels learn their mesh (``traced_on`` is)
        assert resolve_impl("auto", q, k, mask, platform="tpu") == "chunked"
    assert resolve_impl("auto", q, k, mask, platform="gpu") == "chunked"  # float32: no cuDNN
    assert resolve_impl("auto", q.astype(jnp.bfloat16), k, mask, platform="gpu") == "cudnn"


def test_attention_mesh_makes_auto_splash_on_tpu_and_nothing_else_sees_it():
    q, k, v, mask = _inputs(CASES[0])
    mesh = make_mesh({"data": 1}, devices=jax.devices()[:1])
    with attention_mesh(mesh):
        assert resolve_impl("auto", q, k, mask, platform="tpu") == "splash"
        assert resolve_impl("auto", q, k, mask, platform="cpu") == "dense"
        assert jax.sharding.get_abstract_mesh().empty  # not jax's mesh context
    assert resolve_impl("auto", q, k, mask, platform="tpu") == "chunked"


def test_splash_per_shard_on_a_traced_on_mesh_equals_dense(devices8):
    """A program traced on an 8-device mesh (``traced_on``, as the learner's and the
    prefill's are) runs splash per shard in ``shard_map``: rows over data x fsdp, heads over
    tensor; the Pallas interpreter stands in for the TPU."""
    q, k, v, mask = _inputs((4, 13, 13, 4, 2, 8, 4, (10, 13, 13, 3)))
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})

    def splash(q, k, v, m):
        return attention(q, k, v, m, "splash", interpret=True)

    try:
        want = splash(q, k, v, mask)  # on one device
    except Exception as e:  # noqa: BLE001 - an interpreter that cannot run the kernel
        pytest.skip(f"splash does not run in the Pallas interpreter here: {e}")
    assert "shard_map" in str(jax.make_jaxpr(traced_on(splash, mesh))(q, k, v, mask))
    got = jax.jit(traced_on(splash, mesh))(q, k, v, mask)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got, attention(q, k, v, mask, "dense"), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("case", [CASES[0], CASES[3]])
def test_splash_kernel_in_the_pallas_interpreter_equals_dense_on_real_queries(case):
    q, k, v, mask = _inputs(case)
    try:
        out = attention(q, k, v, mask, "splash", interpret=True)
    except (NotImplementedError, RuntimeError) as e:  # pragma: no cover - jax-version dependent
        pytest.skip(f"splash does not run in the Pallas interpreter here: {e}")
    dense = attention(q, k, v, mask, "dense")
    real = np.asarray(mask.dense(*q.shape[:2], k.shape[1]).any(-1))  # queries with a key
    np.testing.assert_allclose(np.asarray(out)[real], np.asarray(dense)[real], rtol=1e-5,
                               atol=1e-5)
    g_splash = _grads("splash", mask, q, k, v, interpret=True)
    g_dense = _grads("dense", mask, q, k, v)
    for name, a, b in zip("qkv", g_splash, g_dense, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4, err_msg=f"d{name}")


def _grad_temp_bytes(impl: str, t: int) -> int:
    """Compiled temporaries of the gradient of a loss over attention at ``T = S = t``."""
    shape = jax.ShapeDtypeStruct((1, t, 2, 16), jnp.float32)
    valid = jax.ShapeDtypeStruct((1, t), jnp.bool_)

    def loss(q, k, v, valid):
        return jnp.sum(attention(q, k, v, CausalMask(kv_valid=valid), impl, block_size=256))

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    return grad.lower(shape, shape, shape, valid).compile().memory_analysis().temp_size_in_bytes


def test_chunked_temporaries_grow_linearly_in_sequence_length():
    chunked = _grad_temp_bytes("chunked", 4096) / _grad_temp_bytes("chunked", 1024)
    dense = _grad_temp_bytes("dense", 4096) / _grad_temp_bytes("dense", 1024)
    assert chunked < 5.0, f"chunked temporaries grew {chunked:.1f}x for 4x the length"
    assert dense > 8.0, f"dense temporaries grew only {dense:.1f}x (the comparison is void)"


def test_unknown_impl_is_refused_in_one_line():
    q, k, v, mask = _inputs(CASES[0])
    with pytest.raises(ValueError, match="expected one of auto, dense, chunked") as e:
        attention(q, k, v, mask, "flash")
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="attention='flash'"):
        ModelConfig.tiny(attention="flash")


def test_cudnn_refuses_what_it_cannot_run_in_one_line():
    q, k, v, mask = _inputs(CASES[0])
    with pytest.raises(ValueError, match="needs bf16/fp16"):
        attention(q, k, v, mask, "cudnn")


def test_model_forward_with_chunked_attention_equals_dense():
    cfg = ModelConfig.tiny(num_layers=1, hidden_size=32, intermediate_size=64, head_dim=8,
                           attention="dense")
    dense_model = Transformer(cfg, rngs=nnx.Rngs(0))
    chunked_model = Transformer(dataclasses.replace(cfg, attention="chunked"), rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 12), 0, cfg.vocab_size)
    am = (jnp.arange(12)[None] < jnp.array([[9], [12]])).astype(jnp.int32)

    def loss(model):
        h = model.hidden_states(tokens, attention_mask=am)
        return jnp.sum(jnp.sin(h) * am[..., None])

    l_d, g_d = nnx.jit(nnx.value_and_grad(loss))(dense_model)
    l_c, g_c = nnx.jit(nnx.value_and_grad(loss))(chunked_model)
    np.testing.assert_allclose(l_c, l_d, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(g_c), jax.tree.leaves(g_d), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-4)
