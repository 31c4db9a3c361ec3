"""Value model: backbone + scalar head; separate params from the policy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tppo_jax.models.transformer import ModelConfig, Transformer
from tppo_jax.models.value import ValueModel

V = 64


def _tokens(b=2, t=12, seed=1):
    return jax.random.randint(jax.random.key(seed), (b, t), 0, V)


@pytest.mark.slow  # ~6 s in one process on 2 shared cores
def test_value_model_from_policy_is_separate():
    model = Transformer(ModelConfig.tiny(vocab_size=V, num_layers=2), rngs=nnx.Rngs(0))
    vm = ValueModel.from_policy(model)
    tok = _tokens()
    policy_h = nnx.jit(lambda m, t: m.hidden_states(t))
    critic_h = nnx.jit(lambda m, t: m.backbone(t))
    values = nnx.jit(lambda m, t: m(t))(vm, tok)
    assert values.shape == (2, 12) and values.dtype == jnp.float32
    np.testing.assert_allclose(values, 0.0)  # zero head: neutral critic
    before = policy_h(model, tok)
    np.testing.assert_allclose(critic_h(vm, tok), before, atol=1e-6)
    # Distinct buffers: editing the critic's backbone leaves the policy alone.
    w = vm.backbone.layers.mlp.up
    assert (w[...].unsafe_buffer_pointer()
            != model.backbone.layers.mlp.up[...].unsafe_buffer_pointer())
    w.set_value(w[...] + 1.0)
    np.testing.assert_array_equal(policy_h(model, tok), before)
    assert not np.allclose(critic_h(vm, tok), before, atol=1e-3)


def test_value_model_own_init_and_grad():
    cfg = ModelConfig.tiny(vocab_size=V, num_layers=2)
    vm = ValueModel(cfg, rngs=nnx.Rngs(1), head_init_std=0.02)
    tok = _tokens()
    mask = jnp.array([[1] * 12, [1] * 6 + [0] * 6])
    grads = nnx.jit(nnx.grad(lambda m: jnp.sum(m(tok, attention_mask=mask) ** 2)))(vm)
    g = grads.head[...]
    assert g.shape == (128,) and np.abs(np.asarray(g)).max() > 0
