"""Sharded decode equals unsharded (greedy), and weights move between the training (FSDP)
and decode (tensor-parallel) layouts by an explicit reshard."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tppo_jax.models.transformer import ModelConfig, create_model
from tppo_jax.parallel.mesh import layout_rules, make_mesh, named_sharding, reshard
from tppo_jax.rollout.generate import SamplingParams, prefill_and_decode

CFG = ModelConfig.tiny(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=16)


def _decode(model, cache):
    b, s = 8, 24
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(4, 60, size=(b, s)), jnp.int32)
    lens = jnp.asarray(rng.integers(3, 9, size=b), jnp.int32)
    out, _ = prefill_and_decode(
        model, cache, tokens, lens, jnp.ones(b, bool), jnp.ones(b, bool),
        jnp.full(b, 12, jnp.int32), jax.random.key(0), jnp.arange(b, dtype=jnp.uint32),
        jnp.int32(0), window=12, eos_id=-1, params=SamplingParams(greedy=True))
    return np.asarray(out.tokens), np.asarray(out.logprobs)


def test_sharded_greedy_decode_equals_unsharded(devices8):
    want = _decode(create_model(CFG, seed=0), create_model(CFG, seed=0).init_cache(8, 24))
    mesh = make_mesh({"fsdp": 4, "tensor": 2})
    model = create_model(CFG, seed=0, mesh=mesh)
    got = _decode(model, model.init_cache(8, 24).shard(mesh))
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_allclose(got[1], want[1], atol=1e-5)


def test_reshard_train_to_decode_layout(devices8):
    mesh = make_mesh({"fsdp": 4, "tensor": 2})
    model = create_model(CFG, seed=0, mesh=mesh)
    state = nnx.state(model)

    def target(var):
        axes = var.get_metadata().get("out_sharding") or (None,) * len(var.shape)
        return named_sharding(mesh, axes, var.shape, rules=layout_rules("decode"))

    shardings = jax.tree.map(target, state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    values = jax.tree.map(lambda v: v.get_value(), state,
                          is_leaf=lambda x: isinstance(x, nnx.Variable))
    moved = reshard(values, shardings)
    gate_before = values["backbone"]["layers"][0]["mlp"]["gate"]
    gate_after = moved["backbone"]["layers"][0]["mlp"]["gate"]
    assert gate_before.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor")
    assert gate_after.sharding.spec == jax.sharding.PartitionSpec(None, "tensor")
    for a, b in zip(jax.tree.leaves(values), jax.tree.leaves(moved), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
