"""The policy's moving average (``optim.policy_ema``): the update rule by hand; in a run it
follows the recursion over the live params without touching them, rollouts sample from the
live params, the held-out eval and the run's readers (``tppo eval`` / ``export``) take the
average, checkpoints hold it and a resume restores it; off, a run's state and checkpoints are
as before."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tppo_jax.config import ConfigError, load_config
from tppo_jax.runs.run_config import frozen
from tppo_jax.trainer.trainer import Trainer
from tppo_jax.weights.params import EMA_ITEM, LIVE_ITEM, ema_update, evaluated, policy_item

SMALL = ["train.warmstart_steps=20", "logging.tensorboard=false", "train.compile_cache=",
         "algo.critic_warmup_steps=0", "optim.warmup_steps=0", "optim.policy_lr=0.01"]


def test_update_rule_by_hand():
    avg = {"w": jnp.array([1.0, 2.0]), "b": jnp.array(4.0, jnp.bfloat16)}
    new = {"w": jnp.array([3.0, 6.0]), "b": jnp.array(0.0, jnp.bfloat16)}
    got = ema_update(avg, new, jnp.float32(0.75))
    np.testing.assert_allclose(got["w"], [1.5, 3.0])  # 0.75 * 1 + 0.25 * 3, 0.75 * 2 + 0.25 * 6
    assert float(got["b"]) == 3.0 and got["b"].dtype == jnp.bfloat16  # stays in its dtype
    np.testing.assert_array_equal(new["w"], [3.0, 6.0])  # the live params are not donated


def test_config_range_and_resume_guard():
    assert policy_item(load_config("smoke")) == LIVE_ITEM
    assert policy_item(load_config("smoke", ["optim.policy_ema=0.9"])) == EMA_ITEM
    for bad in ("1.0", "-0.1"):
        with pytest.raises(ConfigError, match="policy_ema"):
            load_config("smoke", [f"optim.policy_ema={bad}"])
    assert frozen("optim.policy_ema")  # a resume cannot change what the checkpoints hold


def _leaves(tree) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(tree))]


def _close(a, b, **kw) -> None:
    for x, y in zip(_leaves(a), _leaves(b), strict=True):
        np.testing.assert_allclose(x, y, **kw)


@pytest.mark.slow  # ~56 s in one process on 2 shared cores
def test_run_averages_the_policy_checkpoints_and_reads_the_average(tmp_path):
    from tppo_jax.trainer.trainer import TrainHooks
    from tppo_jax.weights.restore import policy_from_run

    decay = 0.5
    cfg = load_config("smoke", [*SMALL, "train.steps=3", f"optim.policy_ema={decay}"])
    # A 20-step warm-start finishes no row: a constant advantage makes the policy move.
    push = TrainHooks(before_update=lambda _, t: t.replace(
        advantages=t.policy_mask.astype(jnp.float32)))
    with Trainer(cfg, tmp_path / "r", progress=False) as run:
        state = run.state
        want = _leaves(state.policy)
        _close(state.policy_ema, state.policy, rtol=0, atol=0)  # starts at the policy
        for _ in range(3):
            run.update(run.collect(), push)
            state = run.state
            live = _leaves(state.policy)
            want = [decay * w + (1 - decay) * p for w, p in zip(want, live, strict=True)]
            _close(state.policy_ema, want, rtol=1e-6, atol=1e-7)
        assert not np.allclose(_leaves(state.policy_ema)[0], live[0])  # not the live params
        # Rollouts sample from the live params, the eval from the average.
        tok = jnp.asarray(np.random.default_rng(0).integers(3, 100, (2, 16)), jnp.int32)
        np.testing.assert_array_equal(np.asarray(run.sched.model(tok)),
                                      np.asarray(run.policy_module(state)(tok)))
        _close(evaluated(state, cfg).policy, state.policy_ema, rtol=0, atol=0)
        evaluated_logits = np.asarray(run.policy_module(evaluated(state, cfg))(tok))
        run.checkpoint(last=True)
        saved_ema, saved_live = _leaves(state.policy_ema), live
    # What a reader of the run (tppo eval / export / serve) gets: the average.
    got = policy_from_run(tmp_path / "r")
    model, step = got.model, got.step
    assert step == 3
    np.testing.assert_allclose(np.asarray(model(tok)), evaluated_logits, rtol=1e-5, atol=1e-5)

    resumed = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=4))
    with Trainer(resumed, tmp_path / "r", resume=True, progress=False) as run:
        state = run.state
        assert run.start == 3
        _close(state.policy_ema, saved_ema, rtol=0, atol=0)
        _close(state.policy, saved_live, rtol=0, atol=0)


@pytest.mark.slow  # ~14 s in one process on 2 shared cores
def test_off_adds_nothing(tmp_path):
    cfg = load_config("smoke", [*SMALL, "train.steps=1"])
    with Trainer(cfg, tmp_path / "r", progress=False) as run:
        state = run.state
        assert state.policy_ema is None and "policy_ema" not in state.items()
        assert evaluated(state, cfg) is state
