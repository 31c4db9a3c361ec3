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
    paired_se,
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
    # Per question the change is 0, -1, -1, +1: sample sd sqrt(2.75 / 3) over sqrt(4).
    assert r["se"]["greedy_paired"] == pytest.approx(100 * math.sqrt(2.75 / 3) / 2)
    assert agg["greedy"]["paired_se"] == pytest.approx(r["se"]["greedy_paired"])


def test_paired_se_counts_a_question_every_seed_loses_once():
    """Two seeds each losing one of 100 questions: the same question is one question moved
    all the way (se 1.0 point), two different ones are two moved halfway (se ~0.70)."""
    same = [{"lost": [0], "gained": []}, {"lost": [0], "gained": []}]
    apart = [{"lost": [0], "gained": []}, {"lost": [1], "gained": []}]
    assert paired_se(same, 100) == pytest.approx(1.0)
    assert paired_se(apart, 100) == pytest.approx(100 * math.sqrt(0.49 / 99) / 10)
    assert paired_se([{"lost": [], "gained": []}], 100) == 0.0


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


def test_heldout_rescore_scores_each_seed_start_once_and_every_final(tmp_path):
    """``--heldout N``: a seed's runs share one starting-policy score (the first run of the
    seed holds it), every run gets its final policy's; existing scores are not redone."""
    from tppo_jax.benchmarks.heldout_rescore import eval_path, rescore_jobs, start_dirs

    runs = {n: tmp_path / n for n in ("tppo-rl-seed0", "tppo-rl-seed1", "tppo-control-seed0",
                                      "ppo-rl-seed0")}
    starts = start_dirs(runs)
    assert starts["ppo-rl-seed0"] == starts["tppo-control-seed0"] == runs["tppo-rl-seed0"]
    assert starts["tppo-rl-seed1"] == runs["tppo-rl-seed1"]
    jobs = rescore_jobs(runs, 256)
    assert len(jobs) == 2 * (2 + 4)  # (2 starts + 4 finals) x (sampled, greedy)
    start = next(j for j in jobs if j.name == "tppo-rl-seed0 start greedy")
    assert start.args == ["eval", str(runs["tppo-rl-seed0"]), "--eval-size", "256", "--out",
                          str(tmp_path / "tppo-rl-seed0" / "eval_start_n256_greedy.json"),
                          "--start", "--greedy"]
    path = eval_path(runs["ppo-rl-seed0"], "final", 256, greedy=False)
    path.parent.mkdir(parents=True)
    path.write_text("{}")
    assert len(rescore_jobs(runs, 256)) == len(jobs) - 1


def test_heldout_rescore_reads_tppo_eval_results_as_a_run_eval(tmp_path):
    """Two ``tppo eval`` JSONs (sampled, greedy) become the in-run eval's format, and the
    learning summary reads them instead of ``summary.json``'s."""
    from tppo_jax.benchmarks.heldout_rescore import eval_path, rescored_evals

    def write(d, which, sampled_avg, greedy_mask):
        d.mkdir(exist_ok=True)
        g = greedy_mask.count("x") / len(greedy_mask) * 100
        eval_path(d, which, 4, greedy=False).write_text(json.dumps(
            {"avg@4": sampled_avg, "pass@4": 100.0, "steps_all_valid_frac": 0.5, "k": 4,
             "boxed_frac": 1.0, "step": 0, "questions": 4}))
        eval_path(d, which, 4, greedy=True).write_text(json.dumps(
            {"avg@1": g, "pass@1": g, "correct_mask": greedy_mask, "k": 1, "step": 0,
             "steps_all_valid_frac": 1.0, "questions": 4}))

    run, first = tmp_path / "ppo-rl-seed0", tmp_path / "tppo-rl-seed0"
    write(first, "start", 50.0, "xx..")
    write(run, "final", 75.0, "xxx.")
    before, after = rescored_evals(run, first, 4)
    assert (before["avg@4"], before["greedy_accuracy"]) == (50.0, 50.0)
    assert after["greedy_correct_mask"] == "xxx." and after["greedy_steps_all_valid_frac"] == 1.0
    (run / "summary.json").write_text(json.dumps({
        "eval_before": _ev(0.0, 0.0, 0.0, "...."), "eval_after": _ev(0.0, 0.0, 0.0, "....")}))
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward_mean": 0.5,
                                                   "train_time_s": 1.0}) + "\n")
    r = summarize_run(run, k=4, n_questions=4, evals=(before, after))
    assert r["delta"]["avg"] == 25.0 and r["delta"]["greedy"] == 25.0
    assert r["greedy_changes"] == {"lost": 0, "gained": 1}


def test_eval_size_grows_only_the_synthetic_held_out_set():
    """``tppo eval --eval-size``: a table source holds out its last rows, so another size
    would score rows the run trained on; refused in one line."""
    from tppo_jax.cli.runs import with_eval_size
    from tppo_jax.config import ConfigError, load_config

    cfg = load_config("longtail")
    assert with_eval_size(cfg, 256).data.eval_size == 256
    # Prefix-stable: the bigger set starts with the run's own questions.
    from tppo_jax.data.run_data import synthetic_task

    own = synthetic_task(cfg).sample(cfg.data.eval_size, "test")
    assert synthetic_task(cfg).sample(256, "test")[:len(own)] == own
    assert with_eval_size(cfg, None) is cfg
    table = load_config("longtail", ["data.source=openai/gsm8k"])
    with pytest.raises(ConfigError, match="trained on"):
        with_eval_size(table, 256)
