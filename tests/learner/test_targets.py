"""The critic's targets pass run as row groups (``Learner.targets``) gives the targets of one
forward over the whole buffer (``oracles.rollout_targets``)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from oracles import rollout_targets

from tppo_jax.config import AlgoConfig, OptimConfig
from tppo_jax.learner import Learner, LearnerConfig, TrainBatch
from tppo_jax.models.transformer import ModelConfig, create_model
from tppo_jax.models.value import ValueModel

P, WINDOW, S = 6, 16, 96


def _window_batch(lengths, seed=0):
    """Rows of ``P`` prompt tokens + responses; each row's current window is its last
    ``<= WINDOW`` response tokens (T-PPO's layout: continuing rows keep their prefix)."""
    rng = np.random.default_rng(seed)
    lengths = np.asarray(lengths)
    b = len(lengths)
    attn = np.arange(S)[None] < lengths[:, None]
    wlen = np.minimum(lengths - P, rng.integers(1, WINDOW + 1, b))
    return TrainBatch(
        tokens=jnp.asarray(np.where(attn, rng.integers(2, 30, (b, S)), 0), jnp.int32),
        attn=jnp.asarray(attn), sample_logprobs=jnp.zeros((b, S), jnp.float32),
        prompt_len=jnp.full(b, P, jnp.int32),
        window_start=jnp.asarray(lengths - wlen, jnp.int32),
        window_len=jnp.asarray(wlen, jnp.int32),
        finished=jnp.asarray(rng.random(b) < 0.6),
        reward=jnp.asarray(rng.choice([-1.0, 1.0], b), jnp.float32),
        correct=jnp.asarray(rng.random(b) < 0.5))


def _critic():
    policy = create_model(ModelConfig.tiny(vocab_size=32))
    gd, st = nnx.split(ValueModel.from_policy(policy))
    return nnx.graphdef(policy), gd, nnx.to_pure_dict(st)


def _fields(targets) -> dict:
    return {f.name: getattr(targets, f.name) for f in dataclasses.fields(targets)
            if getattr(targets, f.name) is not None}  # old_logprobs: set by the step only


@pytest.mark.parametrize("lam_critic", [1.0, 0.9])
@pytest.mark.slow  # ~9 s in one process on 2 shared cores
def test_grouped_targets_equal_one_full_width_pass(lam_critic):
    """Rows of 8..96 columns over 3 width buckets, in groups of 2-4 rows: every target
    (advantages, returns, masks, ``values_old``) equals the one-width pass's, values past a
    row's end included (zero there; every mask is zero there too)."""
    pdef, gd, params = _critic()
    lengths = np.array([90, 8, 40, 12, 70, 33, 9, 20])
    batch = _window_batch(lengths)
    cfg = LearnerConfig(algo=AlgoConfig(lam_critic=lam_critic),
                        optim=OptimConfig(minibatches=2), window=WINDOW, temperature=1.0)
    learner = Learner(pdef, gd, cfg)
    groups = learner.value_groups(lengths, S)
    assert len({g.width for g in groups}) == 3
    assert sorted(np.concatenate([g.rows[g.valid] for g in groups])) == list(range(8))
    got = _fields(jax.device_get(learner.targets(params, batch, lengths)))
    ref = _fields(jax.device_get(rollout_targets(gd, params, batch, cfg)))
    assert got.keys() == ref.keys()
    inside = np.asarray(batch.attn)
    for k, v in ref.items():
        v = np.where(inside, v, 0.0) if k == "values_old" else v
        np.testing.assert_allclose(got[k], v, rtol=1e-5, atol=1e-6, err_msg=k)
    assert np.abs(ref["advantages"]).max() > 0 and np.abs(ref["returns"]).max() > 0


def test_grouped_targets_compile_once_per_group_shape():
    """Two batches of different lengths over the same width buckets reuse the critic's
    executables: one per (rows, width) group shape."""
    pdef, gd, params = _critic()
    cfg = LearnerConfig(algo=AlgoConfig(), optim=OptimConfig(minibatches=2), window=WINDOW,
                        temperature=1.0)
    learner = Learner(pdef, gd, cfg)
    for lengths in ([90, 8, 40, 12, 70, 33, 9, 20], [80, 10, 50, 14, 66, 30, 7, 25]):
        learner.targets(params, _window_batch(lengths), np.array(lengths))
    shapes = {(len(g.rows), g.width) for g in learner.value_groups(
        np.array([90, 8, 40, 12, 70, 33, 9, 20]), S)}
    assert learner.group_values._cache_size() == len(shapes)
