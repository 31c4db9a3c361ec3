"""KL to the reference policy (``algo.kl_coef``): the k3 estimator by hand, a penalty whose
gradient is zero where the policy equals its reference (so the first update is unchanged),
that pulls towards the reference once they differ, and a run whose reference is the policy
RL started from, untouched by the updates and the same after a resume."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from oracles import batch_and_targets, learner_with, update

from tppo_jax import algo
from tppo_jax.config import AlgoConfig, OptimConfig, load_config
from tppo_jax.learner import LearnerConfig, RowPlan
from tppo_jax.models.transformer import ModelConfig, create_model
from tppo_jax.trainer.trainer import Trainer, TrainHooks


def test_k3_hand_computed():
    logp = jnp.log(jnp.array([[0.5, 0.2, 0.9]]))
    ref = jnp.log(jnp.array([[0.25, 0.2, 0.3]]))
    mask = jnp.array([[1.0, 1.0, 0.0]])
    # token 0: d = log(0.25 / 0.5): e^d - d - 1 = 0.5 + log 2 - 1; token 1: 0; token 2 masked
    want = (0.5 + math.log(2.0) - 1.0 + 0.0) / 2.0
    assert float(algo.kl_to_reference(logp, ref, mask)) == pytest.approx(want, rel=1e-6)
    assert float(algo.kl_to_reference(logp, logp, mask)) == 0.0
    # a token the reference finds impossible stays finite (d clamped)
    far = algo.kl_to_reference(jnp.zeros((1, 1)), jnp.full((1, 1), -1e9), jnp.ones((1, 1)))
    assert np.isfinite(float(far))


def _batch(rows: int, width: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    f = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    return {"tokens": jnp.asarray(rng.integers(2, 30, (rows, width)), jnp.int32),
            "attn": jnp.ones((rows, width), bool),
            "sample_logprobs": f(-rng.random((rows, width)) * 3),
            "advantages": f(rng.normal(size=(rows, width))),
            "policy_mask": f(rng.random((rows, width)) < 0.8).at[:, 0].set(0.0),
            "positive_mask": f(rng.random((rows, width)) < 0.3)}


def _update(kl_coef, params, ref, graphdef, batch):
    cfg = LearnerConfig(algo=AlgoConfig(kl_coef=kl_coef), optim=OptimConfig(minibatches=1),
                        window=8, temperature=1.0)
    tx = optax.sgd(1e-2)
    learner = learner_with(graphdef, None, cfg, tx_policy=tx)
    p = jax.tree.map(jnp.array, params)
    new, _, stats = update(learner, "policy", p, tx.init(p), *batch_and_targets(batch),
                           rows=RowPlan(np.full(4, 24), None, np.arange(4)),
                           ref=None if ref is None else jax.tree.map(jnp.array, ref))
    return jax.device_get(new), jax.device_get(stats)


@pytest.mark.slow  # ~28 s in one process on 2 shared cores
def test_penalty_is_zero_at_the_reference_and_pulls_back_once_moved():
    graphdef, state = nnx.split(create_model(ModelConfig.tiny(vocab_size=32)))
    base = nnx.to_pure_dict(state)
    batch = _batch(4, 24)
    plain, s0 = _update(0.0, base, None, graphdef, batch)
    same, s1 = _update(0.5, base, base, graphdef, batch)
    assert float(s1["kl_ref"]) == 0.0 and "kl_ref" not in s0
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(same), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)  # zero gradient at pi = ref
    # from params a plain step away, with no reward signal (advantages and positives zero), a
    # step of the KL term alone brings the policy closer to the reference
    still = dict(batch, advantages=jnp.zeros_like(batch["advantages"]),
                 positive_mask=jnp.zeros_like(batch["positive_mask"]))
    back, s2 = _update(1.0, plain, base, graphdef, still)
    _, s3 = _update(1.0, back, base, graphdef, still)
    assert 0.0 < float(s3["kl_ref"]) < float(s2["kl_ref"])
    with pytest.raises(ValueError, match="kl_coef"):
        _update(0.5, base, None, graphdef, batch)


SMALL = ["train.warmstart_steps=20", "logging.tensorboard=false", "train.compile_cache=",
         "algo.kl_coef=0.1"]


@pytest.mark.slow  # ~59 s in one process on 2 shared cores
def test_run_reference_is_the_starting_policy_and_survives_updates(tmp_path):
    cfg = load_config("smoke", [*SMALL, "train.steps=3", "algo.critic_warmup_steps=0"])
    with Trainer(cfg, tmp_path / "r", progress=False) as run:
        start = jax.device_get(run.state.policy)
        # A 20-step warm-start finishes no row, so every advantage whitens to 0: a constant
        # advantage on the trained tokens makes the policy move.
        push = TrainHooks(before_update=lambda _, t: t.replace(
            advantages=t.policy_mask.astype(jnp.float32)))
        kls = []
        for _ in range(3):
            upd = run.update(run.collect(), push)
            kls.append(float(upd.pstats.get("kl_ref", -1.0)))
        assert kls[0] < 1e-5 < kls[-1], kls  # ~0 at the reference (fp noise); > 0 once moved
        run.checkpoint(last=True)
        ref = jax.device_get(run.ref_policy)
        trained = jax.device_get(run.state.policy)
    same = [np.array_equal(a, b) for a, b in zip(jax.tree.leaves(ref),
                                                  jax.tree.leaves(start), strict=True)]
    assert all(same)  # the updates donate their params' buffers, never the reference's
    assert not all(np.array_equal(a, b) for a, b in zip(
        jax.tree.leaves(trained), jax.tree.leaves(start), strict=True))
    resumed = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=4))
    with Trainer(resumed, tmp_path / "r", resume=True, progress=False) as run:
        assert run.start == 3
        for a, b in zip(jax.tree.leaves(jax.device_get(run.ref_policy)),
                        jax.tree.leaves(start), strict=True):
            np.testing.assert_array_equal(a, b)
