"""VAPO value pretraining: the critic trains on full-length rollouts of the frozen policy
before step 1, once per key; runs that differ only in the rollout window (T-PPO vs PPO) load
the same critic, and the run's policy and critic optimizer are untouched."""

import json

import jax
import numpy as np
import pytest

from tppo_jax.config import load_config
from tppo_jax.trainer.trainer import Trainer
from tppo_jax.trainer.value_pretrain import CURVE, pretrain_key, pretrain_value

SMALL = ["train.warmstart_steps=20", "reward.wrong=-1.0",
         "algo.value_pretrain_steps=2", "logging.tensorboard=false", "train.compile_cache="]


def test_key_is_shared_across_windows_not_across_critics():
    base = pretrain_key(load_config("smoke", SMALL))
    # The method (window, KV policy) and the policy's optimizer do not shape the critic.
    for same in (["rollout.window=64"], ["rollout.kv_policy=reprefill"], ["optim.policy_lr=1e-5"],
                 ["algo.nll_coef=0.5"], ["train.time_budget_s=60"], ["data.eval_size=7"]):
        assert pretrain_key(load_config("smoke", SMALL + same)) == base, same
    for other in (["train.seed=1"], ["optim.value_lr=1e-3"], ["algo.value_pretrain_steps=3"],
                  ["rollout.temperature=0.7"], ["reward.correct=2.0"], ["data.difficulty=2.0"],
                  ["train.warmstart_steps=21"]):
        assert pretrain_key(load_config("smoke", SMALL + other)) != base, other


def _pretrained(tmp_path, name, extra=()):
    cfg = load_config("smoke", [*SMALL, *extra])
    with Trainer(cfg, tmp_path / "runs" / name, progress=False) as run:
        state = run.state
        before = jax.tree.map(np.asarray, state.value)
        out = pretrain_value(run.pretrain_parts(), state)
        got = jax.tree.map(np.asarray, out.value)
        policy_same = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(
            jax.tree.leaves(state.policy), jax.tree.leaves(out.policy), strict=True))
        opt_count = [int(x) for x in jax.tree.leaves(out.value_opt) if np.ndim(x) == 0]
    return before, got, policy_same, opt_count, run.run_dir


@pytest.mark.slow  # ~39 s in one process on 2 shared cores
def test_pretrained_critic_is_cached_and_shared_by_ppo(tmp_path):
    before, tppo, policy_same, counts, run_dir = _pretrained(tmp_path, "tppo")
    assert policy_same  # the policy is frozen
    assert counts and all(c == 0 for c in counts)  # the run's critic optimizer starts fresh
    # The head started at zero and moved (every return is -1 or 1): the critic trained.
    assert not np.array_equal(before["head"], tppo["head"])
    caches = list((tmp_path / "runs").glob("value-pretrain-*/DONE"))
    assert len(caches) == 1
    rows = [json.loads(x) for x in (run_dir / CURVE).read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["finished"] == 8 for r in rows)  # synchronous: every row finishes each step
    # PPO (window = L) of the same seed loads the same critic rather than training its own.
    _, ppo, _, _, ppo_dir = _pretrained(tmp_path, "ppo", ["rollout.window=64"])
    assert len(list((tmp_path / "runs").glob("value-pretrain-*/DONE"))) == 1
    for a, b in zip(jax.tree.leaves(tppo), jax.tree.leaves(ppo), strict=True):
        np.testing.assert_array_equal(a, b)
    assert (ppo_dir / CURVE).read_text() == (run_dir / CURVE).read_text()
