"""A T-PPO update sharded over 8 fake devices equals the unsharded update (issue: scale-out).

Layouts: fsdp=4 x tensor=2 (params sharded, batch over fsdp) and data=8 (pure data parallel).
"""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tppo_jax.config import AlgoConfig, OptimConfig
from tppo_jax.models.transformer import ModelConfig, create_model, param_shardings, shard_model
from tppo_jax.models.value import ValueModel
from tppo_jax.parallel.mesh import batch_sharding, make_mesh
from tppo_jax.train.step import StepConfig, make_optimizer, rollout_targets
from tppo_jax.train.targets import make_targets
from tppo_jax.train.update import make_updater

B, P, W = 8, 4, 8
S = P + W


def _batch(seed=0):
    rng = np.random.default_rng(seed)
    wlen = rng.integers(3, W + 1, size=B)
    tokens = rng.integers(4, 60, size=(B, S)).astype(np.int32)
    attn = np.arange(S)[None] < (P + wlen)[:, None]
    tokens = np.where(attn, tokens, 0)
    return {
        "tokens": tokens, "attn": attn, "prompt_len": np.full(B, P, np.int32),
        "window_start": np.full(B, P, np.int32), "window_len": wlen.astype(np.int32),
        "finished": rng.random(B) < 0.6, "reward": rng.integers(0, 2, B).astype(np.float32),
        "sample_logprobs": np.where(attn, -rng.random((B, S)).astype(np.float32) * 3, 0.0),
        "correct": rng.random(B) < 0.5,
        "shuffle": rng.random((B, 1)).astype(np.float32),  # epoch order, sharded like a row
    }


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
    batch = {k: jnp.asarray(v) for k, v in _batch().items()}
    if mesh is not None:
        batch = {k: jax.device_put(v, batch_sharding(mesh, v.ndim, v.shape))
                 for k, v in batch.items()}
    optim = OptimConfig(warmup_steps=1, minibatches=2)
    scfg = StepConfig(algo=AlgoConfig(window_ignore_tokens=2), optim=optim, window=W,
                      temperature=1.0)
    tx_p, tx_v = make_optimizer(1e-3, optim), make_optimizer(1e-3, optim)
    op, ov = tx_p.init(pp), tx_v.init(vp)
    targets_fn = partial(rollout_targets, vdef, cfg=scfg)
    pol_fn = make_updater("policy", pdef, tx=tx_p, cfg=scfg)
    val_fn = make_updater("value", vdef, tx=tx_v, cfg=scfg)
    if mesh is not None:  # the trainer's path: shardings declared in and out
        targets_fn = make_targets(vdef, scfg, mesh=mesh, params=vp)
        pol_fn = make_updater("policy", pdef, tx=tx_p, cfg=scfg, mesh=mesh, params=pp,
                              opt_state=op)
        val_fn = make_updater("value", vdef, tx=tx_v, cfg=scfg, mesh=mesh, params=vp,
                              opt_state=ov)
    placed = jax.tree.map(lambda x: x.sharding, (pp, vp))
    targets = targets_fn(vp, batch)
    full = {**batch, **targets}
    lengths = np.asarray(jax.device_get(batch["attn"])).sum(1)
    pp, _, pstats = pol_fn(pp, op, full, lengths=lengths)
    # The critic on the finished rows only, gathered from the sharded batch.
    rows = np.flatnonzero(np.asarray(jax.device_get(batch["finished"])))
    vp, _, vstats = val_fn(vp, ov, full, lengths=lengths, rows=rows)
    if mesh is not None:  # updated params come back exactly where they were
        assert jax.tree.map(lambda x: x.sharding, (pp, vp)) == placed
    return jax.device_get((pp, vp, pstats, vstats, targets["advantages"])), pp


@pytest.mark.parametrize("shape", [{"fsdp": 4, "tensor": 2}, {"data": 8}])
@pytest.mark.slow  # ~39 s in one process on 2 shared cores
def test_sharded_update_equals_unsharded(devices8, shape):
    want, _ = _run(None)
    mesh = make_mesh(shape)
    got, live = _run(mesh)  # inputs carry their shardings; jit propagates them
    if "tensor" in shape:  # params really are sharded, not silently replicated
        gate = live["backbone"]["layers"]["mlp"]["gate"]  # [L, H, I]
        assert gate.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor"), \
            gate.sharding
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-4, atol=2e-5)
    assert param_shardings is not None
