"""`--resume` runs with the run's own config.yaml; command-line changes apply on top and are
logged, and changes the checkpoint cannot follow are refused in one line."""

import logging

import pytest

from tppo_jax.config import ConfigError, load_config
from tppo_jax.runs.run_config import changes, frozen, resume_config


@pytest.fixture
def run(tmp_path):
    cfg = load_config("smoke", ["train.steps=6", "data.eval_size=8"])
    (tmp_path / "config.yaml").write_text(cfg.to_yaml())
    return tmp_path, cfg


def test_resume_uses_the_runs_own_config_not_the_default(run, caplog):
    path, saved = run
    with caplog.at_level(logging.INFO):
        cfg = resume_config(str(path), None, [])
    assert cfg == saved and cfg.model.hidden_size == 64  # smoke, not the default 128
    assert "with the run's own config" in caplog.text


def test_overrides_apply_on_top_and_are_logged(run, caplog):
    path, saved = run
    with caplog.at_level(logging.INFO):
        cfg = resume_config(str(path), None, ["train.steps=9", "optim.policy_lr=1e-4"])
    assert cfg.train.steps == 9 and cfg.optim.policy_lr == 1e-4
    assert cfg.rollout == saved.rollout and cfg.data.eval_size == 8
    assert "resume: train.steps changed from 6 to 9" in caplog.text
    assert "resume: optim.policy_lr changed from 0.0002 to 0.0001" in caplog.text


@pytest.mark.parametrize("override", ["model.hidden_size=128", "rollout.group_size=4",
                                      "rollout.max_response_len=128", "rollout.kv_cache=paged",
                                      "data.seed=3", "train.warmstart_steps=10"])
def test_changes_the_checkpoint_cannot_follow_are_refused(run, override):
    path, _ = run
    key = override.split("=")[0]
    with pytest.raises(ConfigError) as e:
        resume_config(str(path), None, [override])
    assert key in str(e.value) and "\n" not in str(e.value) and "new --run-dir" in str(e.value)


def test_a_named_config_counts_by_its_differences(run):
    path, _ = run
    # The launcher resumes with the config and overrides it started with: no change.
    assert resume_config(str(path), "smoke", ["train.steps=6", "data.eval_size=8"]) is not None
    # The default config differs in the model shape: refused, naming it.
    with pytest.raises(ConfigError, match="model.hidden_size"):
        resume_config(str(path), "default", [])


def test_a_run_without_config_yaml_starts_fresh(tmp_path):
    assert resume_config(str(tmp_path / "new"), None, []) is None


def test_frozen_keys():
    assert frozen("model.num_layers") and frozen("rollout.window")
    assert not frozen("train.steps") and not frozen("data.on_bad_row")
    assert not frozen("mesh.fsdp") and not frozen("algo.gamma")
    a = load_config("smoke")
    assert changes(a, a) == {}
