"""The update audit (issue 16): warm-up in training steps, no step on an empty minibatch,
clamped log-ratio, NLL on the grader's verdict, per-epoch shuffle, first-minibatch stats,
AdamW's eps."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from oracles import batch_and_targets, policy_token_logprobs, row_plan_of, update

from tppo_jax import algo
from tppo_jax.config import AlgoConfig, OptimConfig, load_config
from tppo_jax.learner import Learner, LearnerConfig, TrainBatch, compute_targets
from tppo_jax.learner.plan import plan_update
from tppo_jax.learner.state import lr_schedule, make_optimizer, updates_per_step
from tppo_jax.models.transformer import ModelConfig, create_model
from tppo_jax.trainer.collect import shuffle_keys

B, S = 8, 10


def _counts(opt_state) -> list[int]:
    """Every ``count`` leaf of an optax state (Adam's and the schedule's)."""
    leaves = jax.tree_util.tree_flatten_with_path(opt_state)[0]
    return [int(v) for p, v in leaves if "count" in jax.tree_util.keystr(p)]


def _model():
    gd, st = nnx.split(create_model(ModelConfig.tiny(vocab_size=32)))
    return gd, nnx.to_pure_dict(st)


def _learner(gd, optim: OptimConfig) -> Learner:
    return Learner(gd, None, LearnerConfig(algo=AlgoConfig(), optim=optim, window=S,
                                           temperature=1.0))


def _train_batch(seed=0, logp=None) -> dict:
    rng = np.random.default_rng(seed)
    tokens = jnp.asarray(rng.integers(2, 30, size=(B, S)), jnp.int32)
    return {"tokens": tokens, "attn": jnp.ones((B, S), bool),
            "sample_logprobs": jnp.full((B, S), -3.0) if logp is None else logp,
            "advantages": jnp.asarray(rng.normal(size=(B, S)), jnp.float32),
            "policy_mask": jnp.ones((B, S)).at[:, 0].set(0.0), "positive_mask": jnp.zeros((B, S))}


def test_policy_lr_decays_to_zero_over_its_training_steps():
    optim = OptimConfig(warmup_steps=2, minibatches=2, epochs=1, policy_lr_decay_steps=10)
    sched = lr_schedule(1.0, optim, decay_steps=optim.policy_lr_decay_steps)
    n = 4  # warm-up: 2 training steps x 2 updates
    assert float(sched(n)) == pytest.approx(1.0)
    assert float(sched(n + 10)) == pytest.approx(0.5)  # half of 10 steps x 2 updates
    assert float(sched(n + 20)) == pytest.approx(0.0, abs=1e-7)
    assert float(sched(n + 30)) == pytest.approx(0.0, abs=1e-7)  # stays at 0 after it
    assert float(lr_schedule(1.0, optim)(n + 20)) == pytest.approx(1.0)  # no decay: constant


@pytest.mark.slow  # ~14 s in one process on 2 shared cores
def test_warmup_counts_training_steps_not_updates():
    optim = OptimConfig(warmup_steps=5, minibatches=4, epochs=2, policy_lr=1e-3)
    assert updates_per_step(optim) == 8
    sched = lr_schedule(1.0, optim)
    n = 40  # 5 training steps x 4 minibatches x 2 epochs
    assert float(sched(0)) == pytest.approx(1 / n)
    assert float(sched(8)) == pytest.approx(1 / n + (1 - 1 / n) * 8 / n)  # after one step
    assert float(sched(n - 8)) < 1.0 and float(sched(n)) == pytest.approx(1.0)
    # The paper config: 20 warm-up steps x 16 minibatches = 320 updates, not 20.
    paper = load_config("paper_qwen25_32b").optim
    assert float(lr_schedule(1.0, paper)(20)) < 0.1
    # One training step advances the clock by minibatches x epochs updates.
    gd, params = _model()
    learner = _learner(gd, optim)
    _, opt, _ = update(learner, "policy", params, learner.tx_policy.init(params),
                       *batch_and_targets(_train_batch()))
    assert _counts(opt) and set(_counts(opt)) == {8}


@pytest.mark.slow  # ~9 s in one process on 2 shared cores
def test_empty_minibatch_takes_no_step():
    optim = OptimConfig(warmup_steps=1, minibatches=2, policy_lr=1e-2)
    gd, params = _model()
    learner = _learner(gd, optim)
    tx = learner.tx_policy
    before = jax.device_get(params)
    opt0 = tx.init(params)
    opt0_host = jax.device_get(opt0)
    empty = dict(_train_batch(), policy_mask=jnp.zeros((B, S)))
    new, opt, stats = update(learner, "policy", params, opt0, *batch_and_targets(empty))
    # No token anywhere: params and the whole optimizer state are bit-for-bit unchanged.
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(new), before)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(opt), opt0_host)
    assert float(stats["policy_empty_mb"]) == 2 and float(stats["policy_skipped"]) == 0
    # Rows 4..7 (the second minibatch) empty: exactly one update, one tick of the schedule.
    half = dict(_train_batch(), policy_mask=jnp.ones((B, S)).at[B // 2:].set(0.0))
    _, params = _model()
    new, opt, stats = update(learner, "policy", params, tx.init(params),
                             *batch_and_targets(half))
    assert set(_counts(opt)) == {1} and float(stats["policy_empty_mb"]) == 1
    assert any(not np.allclose(a, b) for a, b in zip(jax.tree.leaves(jax.device_get(new)),
                                                      jax.tree.leaves(before), strict=True))


@pytest.mark.parametrize("log_ratio", [88.0, 89.0, 1e4, -1e4])
def test_huge_log_ratio_gives_finite_gradients(log_ratio):
    logp_old = jnp.array([[-5.0, -1.0, -2.0]])
    logp = logp_old.at[0, 0].add(log_ratio)
    mask = jnp.ones((1, 3))
    for adv in (1.0, -1.0, 3.0, -3.0):
        a = jnp.array([[adv, 0.5, -0.5]])

        def f(x, a=a):
            return algo.policy_loss(x, logp_old, a, mask)[0]

        loss, g = jax.value_and_grad(f)(logp)
        assert np.isfinite(float(loss)) and np.all(np.isfinite(np.asarray(g)))
        # Hand value: the clamped token's ratio is e^{+-20}; its loss is the clip (A > 0 and
        # rho large: -1.28 A), the dual clip (A < 0, rho large: 10 |A|) or, rho ~ 0,
        # -rho A ~ 0 (A > 0) / -0.8 A (A < 0); the other two tokens have rho = 1: -A each.
        if log_ratio > 0:
            tok0 = -1.28 * adv if adv > 0 else 10 * abs(adv)
        else:
            tok0 = 0.0 if adv > 0 else -0.8 * adv
        assert float(loss) == pytest.approx((tok0 - 0.5 + 0.5) / 3, abs=1e-5)
    stats = algo.policy_loss(logp, logp_old, a, mask)[1]
    assert float(stats["log_ratio_absmax"]) == 20.0


def test_positive_example_mask_uses_the_graders_verdict():
    b, p, n = 3, 2, 4
    batch = TrainBatch(
        tokens=jnp.zeros((b, p + n), jnp.int32), attn=jnp.ones((b, p + n), bool),
        sample_logprobs=jnp.zeros((b, p + n)), prompt_len=jnp.full((b,), p),
        window_start=jnp.full((b,), p), window_len=jnp.array([4, 3, 2]),
        finished=jnp.array([True, True, True]),
        # Shaped rewards: a wrong row can score > 0, a correct one <= 0.
        reward=jnp.array([0.5, -0.2, 1.0]), correct=jnp.array([False, True, True]))
    pos = np.asarray(compute_targets(jnp.zeros((b, p + n)), batch, AlgoConfig(),
                                     n).positive_mask)
    np.testing.assert_array_equal(pos, [[0, 0, 0, 0, 0, 0], [0, 0, 1, 1, 1, 0],
                                        [0, 0, 1, 1, 0, 0]])


@pytest.mark.slow  # ~10 s in one process on 2 shared cores
def test_minibatches_are_shuffled_per_epoch_reproducibly():
    keys = np.array([[0.3, 0.0], [0.1, 0.1], [0.2, 0.2], [0.0, 0.3]])
    plan = plan_update(np.full(4, 5), minibatches=2, epochs=2, grad_accum=1, unit=1, cap=32,
                       shuffle=keys)
    assert [list(g.rows) for mb in plan for g in mb.groups] == [[3, 1], [2, 0], [0, 1], [2, 3]]
    cfg = load_config("default", ["optim.epochs=2"])
    k = shuffle_keys(cfg, 7, 32)
    assert k.shape == (32, 2) and np.array_equal(k, shuffle_keys(cfg, 7, 32))  # exact resume
    assert not np.array_equal(k, shuffle_keys(cfg, 8, 32))
    assert not np.array_equal(np.argsort(k[:, 0]), np.argsort(k[:, 1]))  # a new order per epoch
    # A shuffled update equals the same update on the rows permuted by hand.
    optim = OptimConfig(warmup_steps=1, minibatches=2, policy_lr=1e-2)
    batch = _train_batch()
    perm = np.random.default_rng(1).permutation(B)
    keys = np.empty((B, 1), np.float32)
    keys[perm, 0] = np.arange(B)  # row perm[i] sorts to position i
    shuffled = batch_and_targets(batch)
    outs = []
    for bt, shuffle in ((shuffled, keys), (batch_and_targets(jax.tree.map(lambda v: v[perm],
                                                                           batch)), None),
                        (shuffled, None)):
        gd, params = _model()
        learner = _learner(gd, optim)
        new, _, _ = update(learner, "policy", params, learner.tx_policy.init(params), *bt,
                           rows=row_plan_of(bt[0], shuffle))
        outs.append(jax.tree.leaves(jax.device_get(new)))
    for a, b in zip(outs[0], outs[1], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    assert any(not np.allclose(a, b) for a, b in zip(outs[0], outs[2], strict=True))


@pytest.mark.slow  # ~13 s in one process on 2 shared cores
def test_first_minibatch_ratio_stats_are_reported_apart():
    """On-policy samples: the first minibatch (no update yet) sees ratio 1 exactly; the
    averaged ratio moves once earlier minibatches have changed the policy."""
    gd, params = _model()
    batch = _train_batch()
    lp, _ = policy_token_logprobs(nnx.merge(gd, params), batch["tokens"], batch["attn"], 1.0)
    optim = OptimConfig(warmup_steps=1, minibatches=4, epochs=2, policy_lr=5e-2)
    learner = _learner(gd, optim)
    _, _, stats = update(learner, "policy", params, learner.tx_policy.init(params),
                         *batch_and_targets(dict(batch, sample_logprobs=lp)))
    assert float(stats["ratio_mean_first_mb"]) == pytest.approx(1.0, abs=1e-5)
    assert float(stats["approx_kl_first_mb"]) == pytest.approx(0.0, abs=1e-6)
    assert float(stats["log_ratio_absmax_first_mb"]) < 1e-4
    assert float(stats["log_ratio_absmax"]) > 1e-3  # the later minibatches saw a moved policy


def test_adam_eps_shrinks_the_steps_of_tiny_gradients_only():
    """``optim.eps``: the first AdamW step is lr * g / (|g| + eps) per parameter (after the
    bias correction), so a gradient far below eps barely moves its parameter while one far
    above still takes a full step."""
    g = {"w": jnp.array([1e-6, 1.0])}
    for eps in (1e-8, 1e-3):
        want = [1e-6 / (1e-6 + eps), 1.0 / (1.0 + eps)]
        optim = OptimConfig(warmup_steps=0, grad_clip=0.0, eps=eps)
        tx = make_optimizer(1.0, optim)
        step, _ = tx.update(g, tx.init(g), {"w": jnp.zeros(2)})
        np.testing.assert_allclose(-step["w"], want, rtol=1e-4)
        assert (want[0] > 0.99) == (eps < 1e-6)  # tiny gradients: a full step only at 1e-8
