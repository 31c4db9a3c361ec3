"""A T-PPO update sharded over 8 fake devices equals the unsharded update (issue: scale-out).

Layouts: fsdp=4 x tensor=2 (params sharded, batch over fsdp) and data=8 (pure data parallel).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from oracles import rollout_targets, update

from tppo_jax.config import AlgoConfig, OptimConfig
from tppo_jax.learner import Learner, LearnerConfig, RowPlan, TrainBatch, TrainState
from tppo_jax.learner.state import policy_optimizer, value_optimizer
from tppo_jax.models.transformer import ModelConfig, create_model, param_shardings, shard_model
from tppo_jax.models.value import ValueModel
from tppo_jax.parallel.mesh import batch_sharding, make_mesh

B, P, W = 8, 4, 8
S = P + W


def _batch(seed=0):
    rng = np.random.default_rng(seed)
    wlen = rng.integers(3, W + 1, size=B)
    tokens = rng.integers(4, 60, size=(B, S)).astype(np.int32)
    attn = np.arange(S)[None] < (P + wlen)[:, None]
    tokens = np.where(attn, tokens, 0)
    return TrainBatch(
        tokens=tokens, attn=attn, prompt_len=np.full(B, P, np.int32),
        window_start=np.full(B, P, np.int32), window_len=wlen.astype(np.int32),
        finished=rng.random(B) < 0.6, reward=rng.integers(0, 2, B).astype(np.float32),
        sample_logprobs=np.where(attn, -rng.random((B, S)).astype(np.float32) * 3, 0.0),
        correct=rng.random(B) < 0.5,
    ), rng.random((B, 1)).astype(np.float32)  # epoch order (RowPlan.shuffle)


def _run(mesh):
    cfg_m = ModelConfig.tiny(vocab_size=64, hidden_size=64, intermediate_size=128,
                             num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
    policy = create_model(cfg_m, seed=0, mesh=mesh)
    critic = ValueModel.from_policy(policy)
    if mesh is not None:  # as the trainer does: the new value head too
        shard_model(critic, mesh)
    pdef, pstate = nnx.split(policy)
    vdef, vstate = nnx.split(critic)
    pp, vp = nnx.to_pure_dict(pstate), nnx.to_pure_dict(vstate)
    batch, shuffle = _batch()
    batch = jax.tree.map(jnp.asarray, batch)
    if mesh is not None:
        batch = jax.tree.map(lambda v: jax.device_put(v, batch_sharding(mesh, v.ndim, v.shape)),
                             batch)
    optim = OptimConfig(warmup_steps=1, minibatches=2, policy_lr=1e-3, value_lr=1e-3)
    cfg = LearnerConfig(algo=AlgoConfig(window_ignore_tokens=2), optim=optim, window=W,
                        temperature=1.0)
    op, ov = policy_optimizer(optim).init(pp), value_optimizer(optim).init(vp)
    lengths = np.asarray(jax.device_get(batch.attn)).sum(1)
    # The critic on the finished rows only, gathered from the sharded batch.
    rows = RowPlan(lengths, shuffle, np.flatnonzero(np.asarray(jax.device_get(batch.finished))))
    if mesh is None:
        learner = Learner(pdef, vdef, cfg)
        targets = rollout_targets(vdef, vp, batch, cfg)
    else:  # the trainer's path: shardings declared in and out, row-grouped targets
        learner = Learner(pdef, vdef, cfg, mesh=mesh, state=TrainState(pp, vp, op, ov))
        targets = learner.targets(vp, batch, lengths)
    placed = jax.tree.map(lambda x: x.sharding, (pp, vp))
    pp, _, pstats = update(learner, "policy", pp, op, batch, targets, rows)
    vp, _, vstats = update(learner, "value", vp, ov, batch, targets, rows)
    if mesh is not None:  # updated params come back exactly where they were
        assert jax.tree.map(lambda x: x.sharding, (pp, vp)) == placed
    return jax.device_get((pp, vp, pstats, vstats, targets.advantages)), pp


@pytest.mark.parametrize("shape", [{"fsdp": 4, "tensor": 2}, {"data": 8}])
@pytest.mark.slow  # ~39 s in one process on 2 shared cores
def test_sharded_update_equals_unsharded(devices8, shape, monkeypatch):
    from tppo_jax.kernels import attention as attn

    want, _ = _run(None)
    mesh = make_mesh(shape)
    seen, resolve = [], attn.resolve_impl  # the mesh each attention traced on

    def spy(*args, **kwargs):
        seen.append(attn.kernel_mesh())
        return resolve(*args, **kwargs)

    monkeypatch.setattr(attn, "resolve_impl", spy)
    got, live = _run(mesh)  # inputs carry their shardings; jit propagates them
    # Every program traced on the learner's mesh: splash attention on TPU, per shard
    assert seen and all(m is mesh for m in seen), seen
    if "tensor" in shape:  # params really are sharded, not silently replicated
        gate = live["backbone"]["layers"]["mlp"]["gate"]  # [L, H, I]
        assert gate.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor"), \
            gate.sharding
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-4, atol=2e-5)
    assert param_shardings is not None
