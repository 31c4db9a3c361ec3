"""tppo bench learning's arithmetic: standard errors, greedy answer changes, the summary of a
run directory and the targets."""

import json
import math

import pytest
from tppo_jax.benchmarks import learning
from tppo_jax.benchmarks.learning import (
    aggregate,
    binomial_se,
    greedy_changes,
    meets,
    summarize_run,
)


def test_binomial_se_and_greedy_changes():
    assert binomial_se(50.0, 100) == pytest.approx(5.0)
    assert binomial_se(100.0, 10) == 0.0
    assert greedy_changes("xx..x", "x.x.x") == {"lost": 1, "gained": 1}
    with pytest.raises(ValueError):
        greedy_changes("x", "xx")


def _ev(avg, pas, greedy, mask):
    return {"avg@4": avg, "pass@4": pas, "greedy_accuracy": greedy,
            "steps_all_valid_frac": 0.5, "greedy_correct_mask": mask, "boxed_frac": 0.9}


def test_summarize_run_reads_summary_and_metrics(tmp_path):
    (tmp_path / "summary.json").write_text(json.dumps({
        "eval_before": _ev(60.0, 90.0, 75.0, "xxx."), "eval_after": _ev(80.0, 95.0, 50.0, "x..x")}))
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [
        {"step": 1, "reward_mean": 0.5, "explained_variance": 0.1, "train_time_s": 2.0},
        {"step": 1, "eval_accuracy": 70.0},
        {"step": 2, "reward_mean": 0.7, "explained_variance": 0.3, "train_time_s": 4.0}]))
    r = summarize_run(tmp_path, k=4, n_questions=4)
    assert r["delta"] == {"avg": 20.0, "pass": 5.0, "greedy": -25.0, "steps_valid": 0.0}
    assert r["greedy_changes"] == {"lost": 2, "gained": 1}
    assert r["greedy_changed_questions"] == {"lost": [1, 2], "gained": [3]}
    assert r["se"]["greedy"] == pytest.approx(math.hypot(binomial_se(75, 4), binomial_se(50, 4)))
    assert r["steps"] == 2 and r["train_time_s"] == 4.0
    assert r["curves"]["explained_variance"] == [0.1, 0.3]
    agg = aggregate([r, r])
    assert agg["avg"] == {"mean": 20.0, "min": 20.0, "max": 20.0}
    assert agg["greedy_changes"] == {"lost": 4, "gained": 2}
    assert agg["greedy_lost_by_question"] == {"1": 2, "2": 2}  # the same two in both runs
    assert meets(agg, avg_gain=15.0, greedy_drop=1.0) == {"avg": True, "pass": True,
                                                         "greedy": False}


def test_finished_runs_are_recognised(tmp_path):
    from tppo_jax.benchmarks.learning import finished

    assert not finished(tmp_path / "missing")
    (tmp_path / "summary.json").write_text(json.dumps({"eval_before": {}, "eval_after": None}))
    assert not finished(tmp_path)  # preempted: no eval after
    (tmp_path / "summary.json").write_text("{trunc")
    assert not finished(tmp_path)
    (tmp_path / "summary.json").write_text(json.dumps({"eval_after": {"avg@4": 1.0}}))
    assert finished(tmp_path)


def test_ppo_runs_keep_the_whole_response_as_window():
    """The learning bench's jobs: seeds then controls per method, the user's overrides on
    each, and PPO's ``l = L`` after them, so a window given for T-PPO does not change PPO."""
    import argparse

    parser = argparse.ArgumentParser()
    learning.add_args(parser)
    args = parser.parse_args(["--methods", "tppo,ppo", "--seeds", "2", "--control-seeds", "1",
                              "rollout.window=16"])
    jobs = dict(learning._jobs(args, 64))
    assert list(jobs) == ["tppo-rl-seed0", "tppo-rl-seed1", "tppo-control-seed0",
                          "ppo-rl-seed0", "ppo-rl-seed1", "ppo-control-seed0"]
    assert jobs["tppo-control-seed0"] == ["train.seed=0", "reward.shuffle_control=true",
                                          "rollout.window=16"]
    assert jobs["ppo-rl-seed1"] == ["train.seed=1", "rollout.window=16", "rollout.window=64"]
    args.methods = "tppo,grpo"
    with pytest.raises(SystemExit, match="unknown method 'grpo'"):
        learning._jobs(args, 64)
