"""Sharded decode equals unsharded (greedy), and weights move between the training (FSDP)
and decode (tensor-parallel) layouts by an explicit reshard."""

import jax
import numpy as np
import pytest
from flax import nnx

from tppo_jax.models.transformer import ModelConfig, create_model, param_shardings
from tppo_jax.parallel.mesh import decode_mesh, layout_rules, make_mesh, named_sharding, reshard
from tppo_jax.rollout.decode import SamplingParams
from tppo_jax.rollout.engine import DecodeEngine

CFG = ModelConfig.tiny(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=16)


def _decode(model, mesh=None):
    """The engine's batched prefill + one 12-token window over a dense cache (on ``mesh``):
    ``decode_prompts``, as the held-out eval runs it."""
    b, s = 8, 24
    rng = np.random.default_rng(0)
    tokens = rng.integers(4, 60, size=(b, s)).astype(np.int32)
    lens = rng.integers(3, 9, size=b).astype(np.int32)
    eng = DecodeEngine(model, eos_ids=(), max_slots=b, max_target_length=s, kv_cache="dense",
                       sampling=SamplingParams(greedy=True), mesh=mesh)
    out = eng.decode_prompts(eng.load_params(model), tokens, lens, 12)
    return np.asarray(out.tokens), np.asarray(out.logprobs)


@pytest.mark.slow  # ~12 s in one process on 2 shared cores
def test_sharded_greedy_decode_equals_unsharded(devices8, monkeypatch):
    from tppo_jax.kernels import attention as attn

    want = _decode(create_model(CFG, seed=0))
    mesh = make_mesh({"fsdp": 4, "tensor": 2})
    seen, resolve = [], attn.resolve_impl  # the mesh the prefill's attention traced on

    def spy(*args, **kwargs):
        seen.append(attn.kernel_mesh())
        return resolve(*args, **kwargs)

    monkeypatch.setattr(attn, "resolve_impl", spy)
    got = _decode(create_model(CFG, seed=0, mesh=mesh), mesh)
    assert seen and all(m is mesh for m in seen), seen  # splash on TPU, per shard
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
    gate_before = values["backbone"]["layers"]["mlp"]["gate"]  # [L, H, I]
    gate_after = moved["backbone"]["layers"]["mlp"]["gate"]
    assert gate_before.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor")
    assert gate_after.sharding.spec == jax.sharding.PartitionSpec(None, None, "tensor")
    for a, b in zip(jax.tree.leaves(values), jax.tree.leaves(moved), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_decode_mesh_splits_devices_into_tensor_parallel_replicas(devices8):
    train = make_mesh({"fsdp": 8})
    dmesh = decode_mesh(train, 2)
    assert dict(dmesh.shape) == {"data": 4, "fsdp": 1, "tensor": 2}
    assert list(dmesh.devices.flat) == list(train.devices.flat)  # same chips, regrouped
    with pytest.raises(ValueError, match="does not divide the 8 devices"):
        decode_mesh(train, 3)


def test_decode_on_replicas_equals_the_training_layout(devices8):
    """FSDP over 8 chips for training; decode on 4 replicas of 2 tensor-parallel chips after
    one reshard: the same greedy tokens and log-probs."""
    train = make_mesh({"fsdp": 8})
    model = create_model(CFG, seed=0, mesh=train)
    want = _decode(model, train)
    dmesh = decode_mesh(train, 2)
    state = nnx.state(model)
    moved = reshard(nnx.to_pure_dict(state),
                    nnx.to_pure_dict(param_shardings(state, dmesh, rules=layout_rules("decode"))))
    gate = moved["backbone"]["layers"]["mlp"]["gate"]  # [layers, embed, mlp]
    assert gate.sharding.mesh.shape["tensor"] == 2
    assert gate.sharding.spec == jax.sharding.PartitionSpec(None, None, "tensor")
    nnx.replace_by_pure_dict(state, moved)
    got = _decode(nnx.merge(nnx.graphdef(model), state), dmesh)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_allclose(got[1], want[1], atol=1e-5)
