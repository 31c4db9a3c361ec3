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


def test_the_api_resume_refuses_what_the_cli_refuses_in_its_own_words(run):
    """H-2 (issue 62): ``fit(..., resume=True)`` resumed with a changed window, data seed
    and eval size and rewrote config.yaml. Now the same refusal as ``--resume``, naming
    ``resume=True``, before config.yaml is touched; a ``Config`` object too (the Trainer's
    own check)."""
    import dataclasses

    import tppo_jax

    path, saved = run
    before = (path / "config.yaml").read_text()
    with pytest.raises(ConfigError) as e:
        tppo_jax.fit("smoke", path, resume=True, progress=False,
                     overrides={"data.seed": 7, "data.eval_size": 16})
    msg = str(e.value)
    assert msg.startswith("resume=True cannot change ") and "--" not in msg, msg
    assert "data.seed (0 -> 7)" in msg and "data.eval_size (8 -> 16)" in msg
    assert "start a new run_dir instead" in msg and "\n" not in msg
    changed = dataclasses.replace(saved, data=dataclasses.replace(saved.data, seed=7))
    with pytest.raises(ConfigError, match=r"^resume=True cannot change data.seed \(0 -> 7\)"):
        tppo_jax.fit(changed, path, resume=True, progress=False)
    assert (path / "config.yaml").read_text() == before


def test_the_api_names_resume_true_not_the_cli_flag(tmp_path):
    """L-13 (issue 62): the API's refusal of a run dir holding a run said "--resume"."""
    import tppo_jax

    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(ConfigError) as e:
        tppo_jax.fit("smoke", tmp_path, progress=False)
    msg = str(e.value)
    assert "resume=True continues that run" in msg and "--resume" not in msg, msg
    assert "`tppo train --start-over`" in msg and "new run_dir" in msg
