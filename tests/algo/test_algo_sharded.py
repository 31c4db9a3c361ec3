"""The pure math gives the same numbers jitted over a sharded 8-device CPU mesh."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tppo_jax.algo import (
    egae,
    length_adaptive_lambda,
    masked_whiten,
    mc_returns,
    policy_loss,
    policy_mask,
    value_loss,
)
from tppo_jax.parallel.mesh import batch_sharding, make_mesh


def _inputs(b=16, t=32, seed=0):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(4, t + 1, size=b)
    mask = (np.arange(t)[None] < lengths[:, None]).astype(np.float32)
    finished = rng.random(b) < 0.5
    rewards = np.zeros((b, t), np.float32)
    rewards[np.arange(b), lengths - 1] = finished * rng.integers(0, 2, size=b)
    values = rng.normal(size=(b, t)).astype(np.float32)
    logp = rng.normal(size=(b, t)).astype(np.float32) * 0.1 - 1
    logp_old = logp + rng.normal(size=(b, t)).astype(np.float32) * 0.05
    return dict(rewards=rewards, values=values, mask=mask, finished=finished,
                lengths=lengths.astype(np.int32), logp=logp, logp_old=logp_old)


def step(x):
    """A full advantage + loss computation, as the trainer composes it."""
    b, t = x["mask"].shape
    lam = length_adaptive_lambda(x["lengths"])
    adv = egae(x["rewards"], x["values"], x["mask"], x["finished"], gamma=1.0, lam=lam)
    pm = policy_mask(t, jnp.zeros(b, jnp.int32), x["lengths"], x["finished"], ignore_last=2)
    adv = masked_whiten(adv, pm)
    ret = mc_returns(x["rewards"], x["mask"])
    vm = x["mask"] * x["finished"][:, None]
    pl, _ = policy_loss(x["logp"], x["logp_old"], adv, pm)
    vl, _ = value_loss(x["values"] * 0.5, x["values"], ret, vm)
    return adv, ret, pl, vl


@pytest.mark.parametrize("shape", [{"data": 8}, {"fsdp": 4, "tensor": 2}, {"data": 2, "fsdp": 4}])
def test_sharded_equals_unsharded(devices8, shape):
    x = _inputs()
    want = jax.jit(step)(x)
    mesh = make_mesh(shape)
    xs = {k: jax.device_put(v, batch_sharding(mesh, np.ndim(v), np.shape(v))) for k, v in x.items()}
    assert xs["mask"].sharding.spec[0] is not None  # actually split over the batch
    with jax.set_mesh(mesh):
        got = jax.jit(step)(xs)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-5, rtol=1e-5)
