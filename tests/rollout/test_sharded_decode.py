"""Sharded decode equals unsharded (greedy), and weights move between the training (FSDP)
and decode (tensor-parallel) layouts by an explicit reshard."""

import jax
import numpy as np
import pytest
from flax import nnx

from tppo_jax.models.transformer import ModelConfig, create_model
from tppo_jax.parallel.mesh import layout_rules, make_mesh, named_sharding, reshard
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
def test_sharded_greedy_decode_equals_unsharded(devices8):
    want = _decode(create_model(CFG, seed=0))
    mesh = make_mesh({"fsdp": 4, "tensor": 2})
    got = _decode(create_model(CFG, seed=0, mesh=mesh), mesh)
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
