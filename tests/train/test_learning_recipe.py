"""The learning recipe's options: the critic's bias starts at the mean reward, the critic can
take more passes per step than the policy, and the shuffled-reward control permutes grades
across a step's finished rows (no signal) without changing how many are right."""

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tppo_jax import algo
from tppo_jax.config import load_config
from tppo_jax.train.batch import init_value_bias, shuffle_keys
from tppo_jax.train.collect import collect, shuffle_grades
from tppo_jax.train.setup import setup
from tppo_jax.train.step import updates_per_step

SMALL = ["train.warmstart_steps=20", "logging.tensorboard=false", "train.compile_cache="]


def test_advantage_mass_hand_computed():
    adv = jnp.array([[1.0, -1.0, 2.0, 0.0], [-2.0, -2.0, 0.0, 0.0], [0.5, 0.5, 0.5, 0.5]])
    mask = jnp.array([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], jnp.float32)
    fin = jnp.array([True, True, False])
    correct = jnp.array([True, False, False])
    out = jax.tree.map(float, algo.advantage_mass(adv, mask, fin, correct))
    assert out["adv_right_mean"] == pytest.approx(2.0 / 3.0)  # (1 - 1 + 2) / 3
    assert out["adv_wrong_mean"] == pytest.approx(-2.0)
    assert out["adv_unfinished_mean"] == pytest.approx(0.5)
    assert out["adv_right_neg_frac"] == pytest.approx(1.0 / 3.0)
    # an empty set reads 0, not nan
    none = algo.advantage_mass(adv, mask, jnp.zeros(3, bool), correct)
    assert float(none["adv_right_mean"]) == 0.0 and float(none["adv_right_neg_frac"]) == 0.0
    assert float(none["adv_unfinished_mean"]) == pytest.approx(0.0)  # (2 - 4 + 2) / 9


def test_value_epochs_scale_the_critics_updates_only():
    cfg = load_config("smoke", ["optim.value_epochs=3", "optim.epochs=1"])
    assert cfg.optim.critic_epochs == 3
    assert updates_per_step(cfg.optim) == cfg.optim.minibatches
    assert updates_per_step(cfg.optim, cfg.optim.critic_epochs) == 3 * cfg.optim.minibatches
    keys = shuffle_keys(cfg, step=0, rows=8)
    assert keys.shape == (8, 3)
    # unset, the critic follows optim.epochs and the shuffle keys are what they were
    plain = load_config("smoke")
    assert plain.optim.critic_epochs == plain.optim.epochs
    assert shuffle_keys(plain, 0, 8).shape == (8, plain.optim.epochs)


def _first_rollout(tmp_path, extra):
    cfg = load_config("smoke", [*SMALL, *extra])
    with contextlib.ExitStack() as stack:
        run, state = setup(cfg, tmp_path / "runs" / "r", resume=False, progress=False,
                           stack=stack)
        roll = collect(run)
        value = init_value_bias(run, state.value, roll)
        return cfg, roll, state.value, value


@pytest.mark.slow  # ~42 s in one process on 2 shared cores
def test_bias_init_is_the_first_rollouts_mean_reward(tmp_path):
    cfg, roll, old, new = _first_rollout(tmp_path, ["algo.value_bias_init=mean_reward",
                                                    "reward.wrong=-1.0"])
    assert len(roll.fin)  # smoke: synchronous, every row finishes
    assert float(new["head_bias"]) == pytest.approx(float(roll.reward[roll.fin].mean()))
    assert float(old["head_bias"]) == 0.0
    assert new["head_bias"].sharding == old["head_bias"].sharding
    for a, b in zip(jax.tree.leaves({**old, "head_bias": 0}),
                    jax.tree.leaves({**new, "head_bias": 0}), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # nothing else moved
    _, _, old0, same = _first_rollout(tmp_path / "zero", [])
    assert same is old0  # "zero" (the default) leaves the critic alone


def test_shuffle_grades_permutes_finished_rows_together():
    reward = np.array([1.0, 0.0, 0.5, 0.0, 1.0, 0.0], np.float32)
    correct = reward == 1.0
    fin = np.array([0, 1, 3, 4])  # rows 2 and 5 are unfinished
    seen = set()
    for seed in range(20):
        r, c = shuffle_grades(reward, correct, fin, np.random.default_rng(seed))
        assert r[2] == 0.5 and r[5] == 0.0  # unfinished rows keep theirs
        assert sorted(r[fin]) == sorted(reward[fin])  # the same grades, on other rows
        np.testing.assert_array_equal(c, r == 1.0)  # reward and verdict move together
        seen.add(tuple(r[fin]))
    assert len(seen) > 1
    np.testing.assert_array_equal(reward, [1.0, 0.0, 0.5, 0.0, 1.0, 0.0])  # inputs untouched


def test_group_baseline_leave_one_out_hand_computed():
    reward = jnp.array([1.0, 0.0, 1.0, 1.0, 0.0, 0.5])
    group = jnp.array([7, 7, 7, 9, 9, 4])
    fin = jnp.array([True, True, True, True, False, True])
    base, has = algo.group_baseline(reward, group, fin)
    np.testing.assert_allclose(base, [0.5, 1.0, 0.5, 0.0, 1.0, 0.0])
    # row 3's only sibling (4) has not finished; row 5 is alone in its group
    np.testing.assert_array_equal(has, [True, True, True, False, True, False])


def test_group_ids_are_unique_over_hosts():
    from tppo_jax.train.batch import global_group_ids

    ids = np.array([0, 0, 5, 5, 7])
    one = global_group_ids(ids, 0, 1)
    np.testing.assert_array_equal(one, ids)  # one process: the scheduler's own ids
    a, b = global_group_ids(ids, 0, 2), global_group_ids(ids, 1, 2)
    assert not set(a.tolist()) & set(b.tolist())  # host 0's group 5 is not host 1's
    np.testing.assert_array_equal(a[:2] == a[1], [True, True])  # siblings stay siblings
    big = global_group_ids(np.array([(1 << 40) + 3]), 3, 4)
    assert big.dtype == np.int32 and big[0] >= 0


def test_group_baseline_frac_hand_computed():
    group = jnp.array([7, 7, 7, 9, 9, 4])
    fin = jnp.array([True, True, False, True, False, True])
    # rows 0 and 1 have each other; 3's sibling has not finished; 5 is alone
    assert float(algo.group_baseline_frac(group, fin)) == pytest.approx(2 / 4)
    assert float(algo.group_baseline_frac(group, jnp.zeros(6, bool))) == 0.0
    # with row 3's group having a sibling graded in an earlier step
    prior_n = jnp.array([0.0, 0.0, 0.0, 1.0, 1.0, 0.0])
    assert float(algo.group_baseline_frac(group, fin, prior_n)) == pytest.approx(3 / 4)


def test_group_baseline_reads_siblings_graded_earlier():
    reward = jnp.array([1.0, 0.0, 1.0, 1.0, 0.0, 0.5])
    group = jnp.array([7, 7, 7, 9, 9, 4])
    fin = jnp.array([True, True, True, True, False, True])
    # group 7 had one sample graded 0 before; group 9 had two, graded 1 and 0
    prior_sum = jnp.array([0.0, 0.0, 0.0, 1.0, 1.0, 0.0])
    prior_n = jnp.array([1.0, 1.0, 1.0, 2.0, 2.0, 0.0])
    base, has = algo.group_baseline(reward, group, fin, prior_sum, prior_n)
    np.testing.assert_allclose(base, [1 / 3, 2 / 3, 1 / 3, 0.5, 2 / 3, 0.0])
    np.testing.assert_array_equal(has, [True, True, True, True, True, False])
    same, _ = algo.group_baseline(reward, group, fin, jnp.zeros(6), jnp.zeros(6))
    np.testing.assert_allclose(same, algo.group_baseline(reward, group, fin)[0])


def test_group_advantage_replaces_egae_on_finished_rows_with_siblings():
    from tppo_jax.train.step import StepConfig, compute_targets

    cfg = load_config("smoke")
    b, s, w = 4, 12, 4
    batch = {"tokens": jnp.ones((b, s), jnp.int32), "prompt_len": jnp.full((b,), 2),
             "window_start": jnp.full((b,), 2), "window_len": jnp.array([3, 4, 4, 2]),
             "finished": jnp.array([True, True, False, True]),
             "reward": jnp.array([1.0, 0.0, 0.0, 1.0]),
             "correct": jnp.array([True, False, False, True]),
             "group": jnp.array([1, 1, 1, 2])}
    values = jnp.full((b, s), 0.25)
    out = {}
    for mode in ("critic", "group"):
        a = dataclasses.replace(cfg.algo, advantage_baseline=mode, whiten_advantages=False,
                                window_ignore_tokens=0)
        out[mode] = np.asarray(compute_targets(values, batch, StepConfig(
            algo=a, optim=cfg.optim, window=w, temperature=1.0))["advantages"])
    g, c = out["group"], out["critic"]
    np.testing.assert_allclose(g[0, 2:5], 1.0)  # 1 - mean(0) of its finished sibling
    np.testing.assert_allclose(g[1, 2:6], -1.0)  # 0 - 1
    np.testing.assert_allclose(g[2], c[2])  # unfinished: EGAE
    np.testing.assert_allclose(g[3], c[3])  # no sibling: EGAE
    assert not np.allclose(g[0], c[0])


def _targets(batch, values, window, **algo_kw):
    from tppo_jax.train.step import StepConfig, compute_targets

    cfg = load_config("smoke")
    kw = {"whiten_advantages": False, "window_ignore_tokens": 0, "length_adaptive": False,
          "lam_policy": 1.0, **algo_kw}
    a = dataclasses.replace(cfg.algo, **kw)
    out = compute_targets(values, batch, StepConfig(algo=a, optim=cfg.optim, window=window,
                                                    temperature=1.0))
    return {k: np.asarray(v) for k, v in out.items()}


def test_policy_trains_response_hand_computed():
    # Rows in their 2nd window (0, 3), 1st (1) and 3rd, unfinished (2); prompts of 2 columns.
    b, s, w = 4, 12, 4
    batch = {"tokens": jnp.ones((b, s), jnp.int32), "prompt_len": jnp.full((b,), 2),
             "window_start": jnp.array([5, 2, 6, 4]), "window_len": jnp.array([3, 4, 4, 2]),
             "finished": jnp.array([True, True, False, True]),
             "reward": jnp.array([1.0, 0.0, 0.0, 1.0]),
             "correct": jnp.array([True, False, False, True]),
             "group": jnp.array([1, 1, 1, 2])}
    values = jnp.full((b, s), 0.25)
    out = _targets(batch, values, w, advantage_baseline="group", policy_trains="response")
    adv, pmask = out["advantages"], out["policy_mask"]
    want = np.zeros((b, s), np.float32)
    want[0, 2:8] = 1.0  # its whole response (both windows): 1 - its finished sibling's 0
    want[1, 2:6] = -1.0  # 0 - 1
    want[3, 2:6] = 0.75  # alone in its group: GAE(lambda 1) on the critic, 1 - V = 0.75
    np.testing.assert_allclose(adv, want)
    np.testing.assert_array_equal(pmask, want != 0)  # row 2 waits: no token, no KL
    window = _targets(batch, values, w, advantage_baseline="group")
    assert window["policy_mask"][2].sum() == 4 and window["policy_mask"][0].sum() == 3
    for k in ("returns", "value_mask", "positive_mask", "lam"):  # the critic's side as before
        np.testing.assert_array_equal(out[k], window[k])


@pytest.mark.parametrize("baseline", ["critic", "group"])
def test_policy_trains_response_is_the_window_when_l_covers_l(baseline):
    # PPO (l >= L): every row's one window is its whole response, so both settings agree
    b, s = 4, 10
    batch = {"tokens": jnp.ones((b, s), jnp.int32), "prompt_len": jnp.array([2, 3, 2, 2]),
             "window_start": jnp.array([2, 3, 2, 2]), "window_len": jnp.array([8, 5, 3, 6]),
             "finished": jnp.array([True, True, True, True]),
             "reward": jnp.array([1.0, 0.0, 1.0, 0.5]),
             "correct": jnp.array([True, False, True, False]),
             "group": jnp.array([1, 1, 2, 2])}
    values = jnp.linspace(0.0, 1.0, b * s).reshape(b, s)
    resp = _targets(batch, values, 8, advantage_baseline=baseline, policy_trains="response",
                    whiten_advantages=True)
    window = _targets(batch, values, 8, advantage_baseline=baseline, whiten_advantages=True)
    for k in window:
        np.testing.assert_allclose(resp[k], window[k], rtol=1e-6, atol=1e-7)


@pytest.mark.slow  # ~46 s in one process on 2 shared cores
def test_policy_trains_response_updates_on_finished_rows_only(tmp_path):
    from tppo_jax.train.loop import TrainHooks, update

    cfg = load_config("smoke", [*SMALL, "algo.policy_trains=response",
                                "algo.critic_warmup_steps=0", "rollout.window=16"])
    seen = []

    def push(_, b):  # the 20-step warm-start earns no reward: a constant advantage moves it
        seen.append(jax.device_get(b))
        return dict(b, advantages=b["policy_mask"].astype(jnp.float32))

    hook = TrainHooks(before_update=push)
    with contextlib.ExitStack() as stack:
        run, state = setup(cfg, tmp_path / "r", resume=False, progress=False, stack=stack)
        cells = []
        for step in range(5):
            before = jax.device_get(state.policy)
            state, upd = update(run, state, collect(run), step, hook, 0)
            cells.append((upd.policy_cells, upd.value_cells))
            moved = not all(np.array_equal(x, y) for x, y in zip(
                jax.tree.leaves(before), jax.tree.leaves(jax.device_get(state.policy)),
                strict=True))
            assert moved == bool(seen[-1]["finished"].any()), step
    fin_steps = [i for i, b in enumerate(seen) if b["finished"].any()]
    assert fin_steps
    longer = 0
    for i, bt in enumerate(seen):
        fin = bt["finished"]
        if not fin.any():  # nothing finished: no policy update at all
            assert cells[i][0] == 0 and not bt["policy_mask"].any()
            continue
        total = bt["window_start"] + bt["window_len"]
        span = (np.arange(bt["tokens"].shape[1])[None] >= bt["prompt_len"][:, None]) & (
            np.arange(bt["tokens"].shape[1])[None] < total[:, None])
        np.testing.assert_array_equal(bt["policy_mask"] > 0, span & fin[:, None])
        assert cells[i][0] == cells[i][1]  # the critic's plan: the finished rows only
        longer += int((fin & (bt["window_start"] > bt["prompt_len"])).sum())
    assert longer  # some trained rows' responses span earlier windows


def test_adam_eps_shrinks_the_steps_of_tiny_gradients_only():
    """``optim.eps``: the first AdamW step is lr * g / (|g| + eps) per parameter (after the
    bias correction), so a gradient far below eps barely moves its parameter while one far
    above still takes a full step."""
    import jax.numpy as jnp

    from tppo_jax.config import OptimConfig
    from tppo_jax.train.step import make_optimizer

    g = {"w": jnp.array([1e-6, 1.0])}
    for eps in (1e-8, 1e-3):
        want = [1e-6 / (1e-6 + eps), 1.0 / (1.0 + eps)]
        optim = OptimConfig(warmup_steps=0, grad_clip=0.0, eps=eps)
        tx = make_optimizer(1.0, optim)
        step, _ = tx.update(g, tx.init(g), {"w": jnp.zeros(2)})
        np.testing.assert_allclose(-step["w"], want, rtol=1e-4)
        assert (want[0] > 0.99) == (eps < 1e-6)  # tiny gradients: a full step only at 1e-8
