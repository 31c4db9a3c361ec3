"""A critic-free estimator (``algo.advantage_baseline: rloo``): the run builds, trains,
checkpoints and compiles no value model and skips value pretraining; it resumes."""

import json

import pytest

from tppo_jax.config import load_config
from tppo_jax.trainer.trainer import Trainer

SMALL = ["train.warmstart_steps=20", "logging.tensorboard=false", "train.compile_cache=",
         "optim.warmup_steps=0", "algo.advantage_baseline=rloo",
         "algo.value_pretrain_steps=2", "algo.critic_warmup_steps=2"]


@pytest.mark.slow  # 19 min measured with 7 agents on 2 cores (two short runs and a resume)
def test_rloo_run_has_no_critic_anywhere_and_resumes(tmp_path):
    cfg = load_config("smoke", [*SMALL, "train.steps=2", "checkpoint.every=1"])
    with Trainer(cfg, tmp_path / "r", progress=False) as run:
        assert run.models.value_def is None and run.state.value is None
        assert run.state.value_opt is None and run.learner.value is None
        assert set(run.learner.compiled_fns()) == {"policy_update"}
        assert "value" not in run.checkpoint_trees()
        summary = run.fit()
    assert summary["steps"] == 2
    rows = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "policy_loss" in r]
    assert len(rows) == 2
    for r in rows:  # no critic's numbers; the policy trained from step 1 (no critic warm-up)
        assert "value_loss" not in r and "explained_variance" not in r
        assert r["value_cells"] == 0 and r["policy_cells"] > 0
    assert not (tmp_path / "r" / "value_pretrain.jsonl").exists()
    step = tmp_path / "r" / "checkpoints" / "2"
    items = {p.name for p in step.iterdir()}
    assert "policy" in items and "value" not in items and "value_opt" not in items
    cfg3 = load_config("smoke", [*SMALL, "train.steps=3", "checkpoint.every=1"])
    with Trainer(cfg3, tmp_path / "r", resume=True, progress=False) as run:
        assert run.start == 2 and run.state.value is None
        assert run.fit()["steps"] == 3
