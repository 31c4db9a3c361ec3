"""Params carry logical axes; on an fsdp x tensor mesh they are sharded and logits match."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from tppo_jax.models.cache import DenseKVCache
from tppo_jax.models.transformer import ModelConfig, Transformer, create_model, shard_model
from tppo_jax.models.value import ValueModel
from tppo_jax.parallel.mesh import make_mesh, named_sharding

V = 128


def test_every_param_has_logical_axes():
    m = Transformer(ModelConfig.tiny(vocab_size=V, tie_embeddings=False), rngs=nnx.Rngs(0))
    for path, var in nnx.to_flat_state(nnx.state(m, nnx.Param)):
        axes = var.get_metadata().get("out_sharding")
        assert axes is not None and len(axes) == var[...].ndim, path


@pytest.mark.slow  # ~7 s in one process on 2 shared cores
def test_sharded_model_matches_unsharded(devices8):
    cfg = ModelConfig.tiny(vocab_size=V, tie_embeddings=False, num_layers=2)
    mesh = make_mesh({"fsdp": 4, "tensor": 2})
    ref = Transformer(cfg, rngs=nnx.Rngs(0))
    tok = jax.random.randint(jax.random.key(0), (8, 16), 0, V)
    fwd = nnx.jit(lambda m, t: m(t))
    want = fwd(ref, tok)
    for sharded in (create_model(cfg, seed=0, mesh=mesh),
                    shard_model(Transformer(cfg, rngs=nnx.Rngs(0)), mesh)):
        layers = sharded.backbone.layers  # stacked: the layer axis is not split
        assert layers.mlp.gate[...].sharding.spec == P(None, "fsdp", "tensor")
        assert layers.mlp.down[...].sharding.spec == P(None, "tensor", "fsdp")
        assert tuple(layers.attn.q[...].sharding.spec)[:3] == (None, "fsdp", "tensor")
        assert sharded.lm_head[...].sharding.spec == P("fsdp", "tensor")
        assert len(layers.mlp.gate[...].addressable_shards) == 8
        got = fwd(sharded, jax.device_put(tok, named_sharding(
            mesh, ("batch", None))))
        np.testing.assert_allclose(got, want, atol=1e-5)


@pytest.mark.slow  # ~8 s in one process on 2 shared cores
def test_sharded_value_model_and_cache(devices8):
    cfg = ModelConfig.tiny(vocab_size=V, num_layers=2)
    mesh = make_mesh({"fsdp": 4, "tensor": 2})
    vm = create_model(cfg, seed=1, mesh=mesh, cls=ValueModel)
    assert vm.backbone.layers.mlp.up[...].sharding.spec == P(None, "fsdp", "tensor")
    tok = jax.random.randint(jax.random.key(0), (4, 8), 0, V)
    vals = nnx.jit(lambda m, t: m(t))(vm, tok)
    assert vals.shape == (4, 8)
    policy = shard_model(Transformer(cfg, rngs=nnx.Rngs(2)), mesh)
    critic = ValueModel.from_policy(policy)
    assert critic.backbone.embed[...].sharding == policy.backbone.embed[...].sharding
    cache = DenseKVCache.init(cfg.num_layers, 4, 8, cfg.num_kv_heads, cfg.head_dim).shard(mesh)
    assert "fsdp" in cache.k.sharding.spec[1] and cache.k.sharding.spec[3] == "tensor"
    step = nnx.jit(lambda m, t, p, c: m.forward_with_cache(t, p, c, valid=t >= 0))
    pos = jnp.broadcast_to(jnp.arange(8)[None], (4, 8))
    logits, cache = step(policy, tok, pos, cache)
    np.testing.assert_allclose(logits, nnx.jit(lambda m, t: m(t))(policy, tok), atol=1e-5)
    np.testing.assert_allclose(nnx.jit(lambda m, t: m(t))(critic, tok), 0.0)
    assert jnp.isfinite(vals).all()
