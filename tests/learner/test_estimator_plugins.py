"""An estimator named as ``package.module:function`` (the rule ``reward.fn`` follows,
``tppo_jax/plugins.py``): imported from the working directory, read by the targets, and refused
in one line, naming the key, when it cannot be found; a registered name keeps working."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from oracles import finished_rows

from tppo_jax import cli
from tppo_jax.config import AlgoConfig, ConfigError, load_config
from tppo_jax.learner import ESTIMATORS, compute_targets, resolve_estimator
from tppo_jax.learner.estimators import needs_critic


def _batch(b=4, p=3, n=6):
    rng = np.random.default_rng(0)
    lens = rng.integers(2, n + 1, size=b)
    batch = finished_rows(rng, lens, p, n, reward=jnp.asarray([1.0, 0.0, 1.0, 0.0], jnp.float32),
                          correct=jnp.asarray([1, 0, 1, 0], bool))
    return batch, jnp.asarray(rng.normal(size=(b, p + n)), jnp.float32)


def test_an_estimator_named_by_its_module_is_the_one_the_targets_read(tmp_path, monkeypatch):
    (tmp_path / "my_est.py").write_text(
        "import jax.numpy as jnp\n"
        "def sevens(w, batch, a):\n    return 7.0 * w.mask\n")
    monkeypatch.chdir(tmp_path)
    name = "my_est:sevens"
    try:
        assert load_config("smoke", [f"algo.advantage_baseline={name}"]).algo.advantage_baseline \
            == name  # validation checks its shape; resolving imports it
        entry = resolve_estimator(name)
        assert entry.fn.__module__ == "my_est" and entry.needs_critic
        a = AlgoConfig(advantage_baseline=name, whiten_advantages=False, advantage_clip=None)
        assert needs_critic(a)
        batch, values = _batch()
        out = jax.jit(compute_targets, static_argnums=(2, 3))(values, batch, a, 6)
        adv, mask = np.asarray(out.advantages), np.asarray(out.policy_mask)
        assert mask.any() and np.all(adv[mask > 0] == 7.0) and np.all(adv[mask == 0] == 0.0)
    finally:
        ESTIMATORS.pop(name, None)


def test_a_registered_function_named_by_its_module_keeps_its_flags():
    """``rloo`` named by where it is defined is still critic-free."""
    name = "tppo_jax.learner.estimators:rloo_estimator"
    try:
        assert not needs_critic(AlgoConfig(advantage_baseline=name))
        assert resolve_estimator(name) is ESTIMATORS["rloo"]
    finally:
        ESTIMATORS.pop(name, None)


@pytest.mark.parametrize("name,match", [
    ("grpo", r"algo.advantage_baseline: 'grpo' is not a registered estimator; "
             r"one of \['critic', 'group', 'rloo'\], or package.module:function"),
    ("no_such_est_module:f", r"algo.advantage_baseline: cannot import no_such_est_module:f: "
                             r"no module named 'no_such_est_module' .*working directory"),
    ("tppo_jax.learner.estimators:ESTIMATORS",
     r"algo.advantage_baseline: tppo_jax.learner.estimators:ESTIMATORS is not callable"),
])
def test_an_estimator_that_names_none_is_one_line(name, match):
    with pytest.raises(ConfigError, match=match) as e:
        resolve_estimator(name)
    assert "\n" not in str(e.value) and name not in ESTIMATORS


def test_the_shape_is_checked_when_the_config_loads_as_reward_fn_is():
    for key in ("algo.advantage_baseline", "reward.fn"):
        with pytest.raises(ConfigError, match=rf"{key}: expected package.module:function, "
                                              r"got ':sevens'"):
            load_config("smoke", [f"{key}=:sevens"])


def test_tppo_config_resolves_the_estimator(capsys):
    rc = cli.main(["config", "--config", "smoke", "algo.advantage_baseline=grpo"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "not a registered estimator" in err[0], err
