"""The learning recipe's options: the critic's bias starts at the mean reward, the critic can
take more passes per step than the policy, and the shuffled-reward control permutes grades
across a step's finished rows (no signal) without changing how many are right."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tppo_jax import algo
from tppo_jax.config import load_config
from tppo_jax.learner.state import updates_per_step
from tppo_jax.trainer.collect import init_value_bias, shuffle_grades, shuffle_keys
from tppo_jax.trainer.trainer import Trainer

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
    with Trainer(cfg, tmp_path / "runs" / "r", progress=False) as trainer:
        roll = trainer.collect()
        value = init_value_bias(trainer.state.value, roll, cfg)
        return cfg, roll, trainer.state.value, value


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
    from tppo_jax.trainer.collect import global_group_ids

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
