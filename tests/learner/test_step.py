"""Trainer math composition: T-PPO with l >= L equals a PPO step; NaN guard skips updates;
a registered estimator is what the targets read; ``Learner.step`` moves both models."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from oracles import batch_and_targets, learner_with, row_plan_of, update

from tppo_jax import algo
from tppo_jax.config import AlgoConfig, OptimConfig
from tppo_jax.learner import (
    ESTIMATORS,
    Learner,
    LearnerConfig,
    TrainBatch,
    TrainState,
    compute_targets,
    register_estimator,
)
from tppo_jax.learner.estimators import reads_groups
from tppo_jax.models.transformer import ModelConfig, create_model
from tppo_jax.models.value import ValueModel


def _batch(b=4, p=3, n=6, seed=0):
    rng = np.random.default_rng(seed)
    s = p + n
    lens = rng.integers(2, n + 1, size=b)
    return TrainBatch(
        tokens=jnp.asarray(rng.integers(2, 30, size=(b, s)), jnp.int32),
        attn=jnp.asarray(np.arange(s)[None] < (p + lens)[:, None]),
        sample_logprobs=jnp.zeros((b, s), jnp.float32),
        prompt_len=jnp.full((b,), p, jnp.int32),
        window_start=jnp.full((b,), p, jnp.int32),
        window_len=jnp.asarray(lens, jnp.int32),
        finished=jnp.ones((b,), bool),
        reward=jnp.asarray(rng.integers(0, 2, size=b), jnp.float32),
        correct=jnp.asarray(rng.integers(0, 2, size=b), bool),
    ), jnp.asarray(rng.normal(size=(b, s)), jnp.float32)


def test_single_window_targets_equal_ppo_gae():
    """With l >= L every row finishes in its first window: EGAE targets == GAE/PPO targets."""
    batch, values = _batch()
    a = AlgoConfig(length_adaptive=False, lam_policy=0.9, whiten_advantages=False,
                   advantage_clip=None, window_ignore_tokens=8)
    out = compute_targets(values, batch, a, 6)
    b, s = batch.shape
    total = batch.window_start + batch.window_len
    rmask = algo.response_mask(s, batch.prompt_len, total)
    rewards = rmask * 0
    rewards = rewards.at[jnp.arange(b), total - 1].set(batch.reward)
    want = algo.gae(rewards, values, rmask, gamma=1.0, lam=0.9)
    # GAE over the full row, restricted to the response (the prompt has no actions).
    np.testing.assert_allclose(out.advantages, want * rmask, atol=1e-5)
    np.testing.assert_allclose(out.policy_mask, rmask)  # finished: nothing dropped
    np.testing.assert_allclose(out.value_mask, rmask)
    np.testing.assert_allclose(out.returns, rmask * batch.reward[:, None])


def test_unfinished_rows_have_no_value_targets_and_drop_tail():
    batch, values = _batch()
    batch = batch.replace(finished=jnp.array([True, False, True, False]),
                          window_len=jnp.full((4,), 6, jnp.int32))
    out = compute_targets(values, batch, AlgoConfig(window_ignore_tokens=2), 6)
    assert float(out.value_mask[1].sum()) == 0 and float(out.value_mask[3].sum()) == 0
    assert float(out.policy_mask[1].sum()) == 4 and float(out.policy_mask[0].sum()) == 6
    assert float(jnp.abs(out.advantages[1, -2:]).sum()) == 0


def test_whiten_center_false_scales_without_shifting_so_signs_stay():
    batch, values = _batch()
    kw = dict(length_adaptive=False, lam_policy=0.9, window_ignore_tokens=8, advantage_clip=None)
    raw = compute_targets(values, batch, AlgoConfig(whiten_advantages=False, **kw), 6)
    out = compute_targets(values, batch, AlgoConfig(whiten_center=False, **kw), 6)
    m = np.asarray(raw.policy_mask) > 0
    r, a = np.asarray(raw.advantages)[m], np.asarray(out.advantages)[m]
    assert np.all(np.sign(r) == np.sign(a))
    np.testing.assert_allclose(a, r / r.std(ddof=1), rtol=1e-4)
    centred = np.asarray(compute_targets(values, batch, AlgoConfig(**kw), 6).advantages)[m]
    assert abs(centred.mean()) < 1e-5 and abs(a.mean()) > 1e-3


def test_registered_estimator_is_the_one_the_targets_read():
    """``register_estimator(name)`` adds an advantage estimator; ``algo.advantage_baseline:
    name`` selects it (here: zeros, so every advantage is zero, whitened or not)."""
    batch, values = _batch()

    @register_estimator("test_zero")
    def zero(w, batch, a):  # [B, W]
        return jnp.zeros_like(w.mask)

    try:
        assert ESTIMATORS["test_zero"].fn is zero and ESTIMATORS["test_zero"].needs_critic
        with pytest.raises(ValueError, match="already registered"):
            register_estimator("test_zero")(zero)
        out = compute_targets(values, batch, AlgoConfig(advantage_baseline="test_zero"), 6)
        assert not np.asarray(out.advantages).any()
        assert np.asarray(out.policy_mask).any()  # the masks are the same as ever
        critic = compute_targets(values, batch, AlgoConfig(), 6)
        assert np.asarray(critic.advantages).any()
        np.testing.assert_array_equal(out.policy_mask, critic.policy_mask)
        np.testing.assert_array_equal(out.returns, critic.returns)
    finally:
        ESTIMATORS.pop("test_zero", None)
    assert "test_zero" not in ESTIMATORS


def test_the_registry_says_which_estimators_report_their_group_coverage():
    """``groups=True`` at registration, not a list of names in the learner, is what makes a
    step report ``group_baseline_frac``."""
    assert [n for n in ("critic", "group", "rloo")
            if reads_groups(AlgoConfig(advantage_baseline=n))] == ["group", "rloo"]
    register_estimator("test_siblings", groups=True)(lambda w, batch, a: w.mask)
    try:
        assert reads_groups(AlgoConfig(advantage_baseline="test_siblings"))
    finally:
        ESTIMATORS.pop("test_siblings", None)


@pytest.mark.slow  # ~35 s in one process on 2 shared cores (a new test)
def test_learner_step_moves_both_models_and_reports_their_stats():
    policy = create_model(ModelConfig.tiny(vocab_size=32))
    critic = ValueModel.from_policy(policy)
    (pdef, pst), (vdef, vst) = nnx.split(policy), nnx.split(critic)
    cfg = LearnerConfig(algo=AlgoConfig(), optim=OptimConfig(warmup_steps=1, minibatches=2),
                        window=6, temperature=1.0)
    learner = Learner(pdef, vdef, cfg)
    pp, vp = nnx.to_pure_dict(pst), nnx.to_pure_dict(vst)
    state = TrainState(pp, vp, learner.tx_policy.init(pp), learner.tx_value.init(vp), step=3)
    batch, _ = _batch(b=8, seed=1)
    batch = batch.replace(sample_logprobs=jnp.full(batch.shape, -3.0),
                          finished=jnp.arange(8) % 4 != 3,
                          reward=jnp.asarray(np.arange(8) % 2, jnp.float32),
                          correct=jnp.arange(8) % 2 == 1)
    before = jax.device_get((state.policy, state.value))  # the step donates its params
    new, stats = learner.step(state, batch, row_plan_of(batch))
    assert new.step == 4
    for was, now in zip(before, jax.device_get((new.policy, new.value)), strict=True):
        assert any(not np.allclose(a, b) for a, b in zip(
            jax.tree.leaves(was), jax.tree.leaves(now), strict=True))
    assert np.isfinite(float(stats.policy["policy_loss"]))
    assert np.isfinite(float(stats.value["value_loss"]))
    assert np.isfinite(float(stats.advantages["adv_right_mean"]))
    assert float(stats.policy["policy_skipped"]) == 0 and float(stats.value["value_skipped"]) == 0
    assert stats.policy_cells > 0 and stats.value_cells > 0
    assert "group_baseline_frac" not in stats.advantages  # the critic's estimator: no groups


@pytest.mark.slow  # ~11 s in one process on 2 shared cores
def test_nan_loss_skips_update():
    gd, st = nnx.split(create_model(ModelConfig.tiny(vocab_size=32)))
    params = nnx.to_pure_dict(st)
    optim = OptimConfig(warmup_steps=1, minibatches=1, policy_lr=1e-2)
    learner = Learner(gd, None, LearnerConfig(algo=AlgoConfig(), optim=optim, window=6,
                                              temperature=1.0))
    tx = learner.tx_policy
    opt = tx.init(params)
    tokens = _batch()[0].tokens
    b, s = tokens.shape
    arrays = {"tokens": tokens, "attn": jnp.ones((b, s), bool),
              "sample_logprobs": jnp.full((b, s), jnp.nan), "advantages": jnp.ones((b, s)),
              "policy_mask": jnp.ones((b, s)), "positive_mask": jnp.zeros((b, s))}
    before = jax.tree.map(np.array, params)
    new, _, stats = update(learner, "policy", params, opt, *batch_and_targets(arrays))
    assert float(stats["policy_skipped"]) == 1.0
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(new), before)
    # A finite batch does update.
    arrays["sample_logprobs"] = jnp.full((b, s), -3.0)
    opt = tx.init(new)
    new2, _, stats = update(learner, "policy", new, opt, *batch_and_targets(arrays))
    assert float(stats["policy_skipped"]) == 0.0
    leaves = zip(jax.tree.leaves(new2), jax.tree.leaves(before), strict=True)
    assert any(not np.allclose(a, b) for a, b in leaves)
    assert isinstance(tx, optax.GradientTransformation)


@pytest.mark.slow  # ~11 s in one process on 2 shared cores
def test_gradient_accumulation_matches_one_big_batch():
    """Two identical micro-batches accumulated == one step on their concatenation."""
    gd, st = nnx.split(create_model(ModelConfig.tiny(vocab_size=32)))
    base = nnx.to_pure_dict(st)
    tokens = _batch(b=2)[0].tokens
    b, s = tokens.shape
    half = {"tokens": tokens, "attn": jnp.ones((b, s), bool),
            "sample_logprobs": jnp.full((b, s), -3.0), "advantages": jnp.ones((b, s)),
            "policy_mask": jnp.ones((b, s)), "positive_mask": jnp.zeros((b, s))}
    full = batch_and_targets(jax.tree.map(lambda x: jnp.concatenate([x, x]), half))
    outs = []
    for accum in (1, 2):
        optim = OptimConfig(warmup_steps=1, minibatches=1, grad_accum=accum)
        tx = optax.sgd(1.0)  # params move by exactly the (averaged) gradient
        cfg = LearnerConfig(algo=AlgoConfig(), optim=optim, window=6, temperature=1.0)
        learner = learner_with(gd, None, cfg, tx_policy=tx)
        params = jax.tree.map(jnp.array, base)
        new, _, _ = update(learner, "policy", params, tx.init(params), *full)
        outs.append(jax.device_get(new))
    for a, b2 in zip(jax.tree.leaves(outs[0]), jax.tree.leaves(outs[1]), strict=True):
        np.testing.assert_allclose(a, b2, rtol=1e-4, atol=1e-6)


@pytest.mark.slow  # compiles a learner step of the tiny model
def test_the_python_docs_learner_example_runs(capsys):
    """docs/python.md's ``Learner.step`` example, as written, trains one step."""
    from pathlib import Path

    text = (Path(__file__).parents[2] / "docs" / "python.md").read_text()
    block = text.split("## The learner on its own arrays", 1)[1].split("```python\n", 1)[1]
    exec(compile(block.split("```", 1)[0], "docs/python.md", "exec"), {})
    step, policy_loss, value_loss = capsys.readouterr().out.split()
    assert step == "1" and np.isfinite(float(policy_loss)) and float(value_loss) > 0
