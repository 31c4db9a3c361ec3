"""Trainer math composition: T-PPO with l >= L equals a PPO step; NaN guard skips updates."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from tppo_jax import algo
from tppo_jax.config import AlgoConfig, OptimConfig
from tppo_jax.models.transformer import ModelConfig, create_model
from tppo_jax.train.step import StepConfig, compute_targets, make_optimizer
from tppo_jax.train.update import policy_update


def _batch(b=4, p=3, n=6, seed=0):
    rng = np.random.default_rng(seed)
    s = p + n
    lens = rng.integers(2, n + 1, size=b)
    return {
        "tokens": jnp.asarray(rng.integers(2, 30, size=(b, s)), jnp.int32),
        "prompt_len": jnp.full((b,), p, jnp.int32),
        "window_start": jnp.full((b,), p, jnp.int32),
        "window_len": jnp.asarray(lens, jnp.int32),
        "finished": jnp.ones((b,), bool),
        "reward": jnp.asarray(rng.integers(0, 2, size=b), jnp.float32),
        "correct": jnp.asarray(rng.integers(0, 2, size=b), bool),
    }, jnp.asarray(rng.normal(size=(b, s)), jnp.float32)


def test_single_window_targets_equal_ppo_gae():
    """With l >= L every row finishes in its first window: EGAE targets == GAE/PPO targets."""
    batch, values = _batch()
    a = AlgoConfig(length_adaptive=False, lam_policy=0.9, whiten_advantages=False,
                   advantage_clip=None, window_ignore_tokens=8)
    cfg = StepConfig(algo=a, optim=OptimConfig(), window=6, temperature=1.0)
    out = compute_targets(values, batch, cfg)
    b, s = batch["tokens"].shape
    total = batch["window_start"] + batch["window_len"]
    rmask = algo.response_mask(s, batch["prompt_len"], total)
    rewards = rmask * 0
    rewards = rewards.at[jnp.arange(b), total - 1].set(batch["reward"])
    want = algo.gae(rewards, values, rmask, gamma=1.0, lam=0.9)
    # GAE over the full row, restricted to the response (the prompt has no actions).
    np.testing.assert_allclose(out["advantages"], want * rmask, atol=1e-5)
    np.testing.assert_allclose(out["policy_mask"], rmask)  # finished: nothing dropped
    np.testing.assert_allclose(out["value_mask"], rmask)
    np.testing.assert_allclose(out["returns"], rmask * batch["reward"][:, None])


def test_unfinished_rows_have_no_value_targets_and_drop_tail():
    batch, values = _batch()
    batch["finished"] = jnp.array([True, False, True, False])
    batch["window_len"] = jnp.full((4,), 6, jnp.int32)
    cfg = StepConfig(algo=AlgoConfig(window_ignore_tokens=2), optim=OptimConfig(), window=6,
                     temperature=1.0)
    out = compute_targets(values, batch, cfg)
    assert float(out["value_mask"][1].sum()) == 0 and float(out["value_mask"][3].sum()) == 0
    assert float(out["policy_mask"][1].sum()) == 4 and float(out["policy_mask"][0].sum()) == 6
    assert float(jnp.abs(out["advantages"][1, -2:]).sum()) == 0


def test_blame_start_zeroes_the_advantage_before_it_and_whitens_over_the_rest():
    batch, values = _batch()
    a = AlgoConfig(length_adaptive=False, lam_policy=0.9, window_ignore_tokens=8)
    cfg = StepConfig(algo=a, optim=OptimConfig(), window=6, temperature=1.0)
    base = compute_targets(values, batch, cfg)
    blame = jnp.array([0, 5, 0, 4], jnp.int32)  # rows 1 and 3: columns before 5 / 4 spared
    out = compute_targets(values, {**batch, "blame_start": blame}, cfg)
    keep = base["policy_mask"] * (jnp.arange(9)[None] >= blame[:, None])
    adv = np.asarray(out["advantages"])
    assert not adv[1, :5].any() and not adv[3, :4].any()
    np.testing.assert_allclose(out["policy_mask"], base["policy_mask"])  # the KL term's tokens
    # whitened over the tokens that keep an advantage: the same raw advantages, other stats
    raw = compute_targets(values, batch, StepConfig(
        algo=AlgoConfig(length_adaptive=False, lam_policy=0.9, window_ignore_tokens=8,
                        whiten_advantages=False, advantage_clip=None),
        optim=OptimConfig(), window=6, temperature=1.0))["advantages"]
    want = algo.masked_whiten(raw, keep) * keep
    np.testing.assert_allclose(adv, want, atol=1e-5)
    assert float(jnp.abs(out["advantages"][1, 5:] - base["advantages"][1, 5:]).max()) > 1e-3


def test_whiten_center_false_scales_without_shifting_so_signs_stay():
    batch, values = _batch()
    kw = dict(length_adaptive=False, lam_policy=0.9, window_ignore_tokens=8, advantage_clip=None)
    raw = compute_targets(values, batch, StepConfig(
        algo=AlgoConfig(whiten_advantages=False, **kw), optim=OptimConfig(), window=6,
        temperature=1.0))
    out = compute_targets(values, batch, StepConfig(
        algo=AlgoConfig(whiten_center=False, **kw), optim=OptimConfig(), window=6,
        temperature=1.0))
    m = np.asarray(raw["policy_mask"]) > 0
    r, a = np.asarray(raw["advantages"])[m], np.asarray(out["advantages"])[m]
    assert np.all(np.sign(r) == np.sign(a))
    np.testing.assert_allclose(a, r / r.std(ddof=1), rtol=1e-4)
    centred = np.asarray(compute_targets(values, batch, StepConfig(
        algo=AlgoConfig(**kw), optim=OptimConfig(), window=6, temperature=1.0))["advantages"])[m]
    assert abs(centred.mean()) < 1e-5 and abs(a.mean()) > 1e-3


@pytest.mark.slow  # ~11 s in one process on 2 shared cores
def test_nan_loss_skips_update():
    model = create_model(ModelConfig.tiny(vocab_size=32))
    gd, st = nnx.split(model)
    params = nnx.to_pure_dict(st)
    optim = OptimConfig(warmup_steps=1, minibatches=1)
    tx = make_optimizer(1e-2, optim)
    opt = tx.init(params)
    batch, _ = _batch()
    b, s = batch["tokens"].shape
    train = {"tokens": batch["tokens"], "attn": jnp.ones((b, s), bool),
             "sample_logprobs": jnp.full((b, s), jnp.nan), "advantages": jnp.ones((b, s)),
             "policy_mask": jnp.ones((b, s)), "positive_mask": jnp.zeros((b, s))}
    cfg = StepConfig(algo=AlgoConfig(), optim=optim, window=6, temperature=1.0)
    before = jax.tree.map(np.array, params)
    new, _, stats = policy_update(gd, params, opt, train, tx=tx, cfg=cfg)
    assert float(stats["policy_skipped"]) == 1.0
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(new), before)
    # A finite batch does update.
    train["sample_logprobs"] = jnp.full((b, s), -3.0)
    opt = tx.init(new)
    new2, _, stats = policy_update(gd, new, opt, train, tx=tx, cfg=cfg)
    assert float(stats["policy_skipped"]) == 0.0
    leaves = zip(jax.tree.leaves(new2), jax.tree.leaves(before), strict=True)
    assert any(not np.allclose(a, b) for a, b in leaves)
    assert isinstance(tx, optax.GradientTransformation)


@pytest.mark.slow  # ~11 s in one process on 2 shared cores
def test_gradient_accumulation_matches_one_big_batch():
    """Two identical micro-batches accumulated == one step on their concatenation."""
    model = create_model(ModelConfig.tiny(vocab_size=32))
    gd, st = nnx.split(model)
    base = nnx.to_pure_dict(st)
    batch, _ = _batch(b=2)
    b, s = batch["tokens"].shape
    half = {"tokens": batch["tokens"], "attn": jnp.ones((b, s), bool),
            "sample_logprobs": jnp.full((b, s), -3.0), "advantages": jnp.ones((b, s)),
            "policy_mask": jnp.ones((b, s)), "positive_mask": jnp.zeros((b, s))}
    full = jax.tree.map(lambda x: jnp.concatenate([x, x]), half)
    outs = []
    for accum in (1, 2):
        optim = OptimConfig(warmup_steps=1, minibatches=1, grad_accum=accum)
        tx = optax.sgd(1.0)  # params move by exactly the (averaged) gradient
        params = jax.tree.map(jnp.array, base)
        cfg = StepConfig(algo=AlgoConfig(), optim=optim, window=6, temperature=1.0)
        new, _, _ = policy_update(gd, params, tx.init(params), full, tx=tx, cfg=cfg)
        outs.append(jax.device_get(new))
    for a, b2 in zip(jax.tree.leaves(outs[0]), jax.tree.leaves(outs[1]), strict=True):
        np.testing.assert_allclose(a, b2, rtol=1e-4, atol=1e-6)
