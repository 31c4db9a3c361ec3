"""The T-PPO vs PPO benchmark's summary: hand-computed throughput, split and speedup."""

import json

import pytest

from tppo_jax.benchmarks.tppo_vs_ppo import _medians, _out_name, summarize_run


def _write(run, steps):
    rows = []
    for i, (fin, rlen, t_roll) in enumerate(steps, 1):
        rows.append({"step": i, "reward_mean": 0.0, "finished": fin, "finished_frac": fin / 8,
                     "response_len_mean": rlen, "response_len_max": 2 * rlen, "tokens": 64,
                     "occupancy": 0.5, "time_rollout_s": t_roll, "time_grading_s": 0.1,
                     "time_update_s": 0.5, "time_compile_s": 2.0 if i == 1 else 0.0,
                     "compiles": 3 if i == 1 else 0, "train_time_s": 3.0 * i})
    rows.append({"step": 2, "eval_accuracy": 40.0})
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (run / "eval_before.json").write_text(json.dumps({"accuracy": 20.0}))


def test_summary_hand_values(tmp_path):
    _write(tmp_path / "a", [(4, 10.0, 1.0), (2, 30.0, 1.0)])
    s = summarize_run(tmp_path / "a", target=35.0)
    assert s["finished_samples"] == 6 and s["finished_per_s"] == pytest.approx(3.0)
    assert s["useful_tokens_per_s"] == pytest.approx((4 * 10 + 2 * 30) / 2.0)
    assert s["time_split_s"] == {"rollout": 2.0, "grading": pytest.approx(0.2),
                                 "update": 1.0, "compile": 2.0}
    assert s["time_to_target_s"] == 6.0 and s["steps_to_target"] == 2 and s["compiles"] == 3
    assert s["samples_to_target"] == 6
    assert s["curve"] == [(0.0, 20.0), (6.0, 40.0)]
    assert summarize_run(tmp_path / "a", target=50.0)["time_to_target_s"] is None
    assert summarize_run(tmp_path / "a", target=50.0)["samples_to_target"] is None
    seeds = {"0": {"tppo": s, "ppo": s, "speedup": 2.0, "throughput_ratio": 3.0},
             "1": {"tppo": s, "ppo": s, "speedup": None, "throughput_ratio": 1.0}}
    med = _medians(seeds)
    assert med["speedup"] == 2.0 and med["throughput_ratio"] == 2.0
    assert med["finished_per_s"] == {"tppo": 3.0, "ppo": 3.0}
    assert _out_name("default") == "tppo_vs_ppo"
    assert _out_name("longtail") == _out_name("configs/longtail.yaml") == "tppo_vs_ppo_longtail"


def test_speedup_bounds_when_a_run_stops_first():
    """PPO reached the target at 200 s; T-PPO had not by its last eval at 600 s: the speedup
    is at most 1/3. The median's bounds come from the seeds' bounds."""
    from tppo_jax.benchmarks.tppo_vs_ppo import _median_bounds, _speedup_bounds

    run = lambda t: {"time_to_target_s": t, "curve": [(0.0, 40.0), (600.0, 50.0)]}  # noqa: E731
    assert _speedup_bounds(run(None), run(200.0)) == [0.0, pytest.approx(1 / 3)]
    assert _speedup_bounds(run(150.0), run(None)) == [4.0, None]
    assert _speedup_bounds(run(100.0), run(200.0)) == [2.0, 2.0]
    assert _speedup_bounds(run(None), run(None)) == [0.0, None]
    assert _median_bounds([[0.0, 0.5], [2.0, 2.0], [0.0, None]]) == [0.0, 2.0]
    assert _median_bounds([[0.0, None], [0.0, None], [1.0, 1.0]]) == [0.0, None]


def test_target_sweep_and_final_eval(tmp_path):
    """Times to several targets read off each run's curve, the speedup over the seeds where
    both methods reached one, and the last eval's metrics in full."""
    from tppo_jax.benchmarks.tppo_vs_ppo import target_sweep, time_to

    curve = [(0.0, 30.0), (50.0, 34.0), (100.0, 37.0), (150.0, 36.0)]
    assert time_to(curve, 34.0) == 50.0 and time_to(curve, 36.5) == 100.0
    assert time_to(curve, 40.0) is None
    run = lambda c: {"curve": c}  # noqa: E731
    seeds = {"0": {"tppo": run(curve), "ppo": run([(0.0, 30.0), (100.0, 35.0), (200.0, 38.0)])},
             "1": {"tppo": run([(0.0, 30.0), (60.0, 33.0)]), "ppo": run([(0.0, 30.0),
                                                                         (120.0, 34.0)])}}
    sw = target_sweep(seeds, [34.0, 37.0])
    assert sw["34"]["speedup"] == 2.0 and sw["34"]["seeds_both_reached"] == 1
    assert sw["34"]["reached_tppo"] == 1 and sw["34"]["reached_ppo"] == 2
    assert sw["34"]["time_to_target_s_ppo"] == 110.0
    assert sw["37"] == {"time_to_target_s_tppo": 100.0, "time_to_target_s_ppo": 200.0,
                        "reached_tppo": 1, "reached_ppo": 1, "speedup": 2.0,
                        "seeds_both_reached": 1}
    _write(tmp_path / "b", [(4, 10.0, 1.0)])
    with (tmp_path / "b" / "metrics.jsonl").open("a") as f:
        f.write("\n" + json.dumps({"step": 1, "eval_accuracy": 41.0, "eval_pass@8": 80.0,
                                   "eval_greedy_accuracy": 60.0, "eval_greedy_correct_mask": "x."}))
    s = summarize_run(tmp_path / "b", target=35.0)
    assert s["final_eval"] == {"accuracy": 41.0, "pass@8": 80.0, "greedy_accuracy": 60.0}
    assert _medians({"0": {"tppo": s, "ppo": s, "speedup": None, "throughput_ratio": None}}
                    )["final_eval"]["tppo"]["greedy_accuracy"] == 60.0


def test_jobs_train_each_seeds_two_runs_side_by_side(tmp_path, monkeypatch):
    """--jobs 2: every (seed, method) run as a ``tppo train`` job, a seed's T-PPO and PPO
    next to each other in the queue, each with the run's overrides; PPO at l = L even when
    the overrides give the T-PPO runs another window."""
    import argparse

    from tppo_jax.benchmarks import tppo_vs_ppo

    got = {}
    monkeypatch.setattr(tppo_vs_ppo, "run_jobs",
                        lambda jobs, n, label: got.update(jobs=jobs, n=n))
    parser = argparse.ArgumentParser()
    tppo_vs_ppo.add_args(parser)
    args = parser.parse_args(["--config", "smoke", "--seeds", "2", "--jobs", "2",
                              "--sweep", "30,40", "algo.kl_coef=0.5",
                              "rollout.window=16"])
    assert args.sweep == [30.0, 40.0]
    monkeypatch.setattr("tppo_jax.weights.warmstart.cached", lambda *a, **k: None)
    tppo_vs_ppo._train_side_by_side(args, 64, tmp_path)
    assert got["n"] == 2
    assert [j.name for j in got["jobs"]] == ["tppo-seed0", "ppo-seed0", "tppo-seed1",
                                             "ppo-seed1"]
    ppo1 = got["jobs"][3].args
    assert ppo1[:5] == ["train", "--config", "smoke", "--run-dir", str(tmp_path / "ppo-seed1")]
    assert {"train.seed=1", "rollout.window=64", "algo.kl_coef=0.5"} <= set(ppo1)
    assert ppo1[-1] == "rollout.window=64"  # the last word on the window: PPO stays l = L
    assert "rollout.window=64" not in got["jobs"][2].args
    assert got["jobs"][2].args[-1] == "rollout.window=16"


def test_summary_records_the_window_the_overrides_gave(tmp_path):
    """``--summarize-only rollout.window=8``: the JSON names the window the T-PPO runs had
    and the overrides, not the config's own window."""
    import argparse

    from tppo_jax.benchmarks import tppo_vs_ppo

    for method in ("tppo", "ppo"):
        _write(tmp_path / "runs" / "smoke" / f"{method}-seed0", [(4, 10.0, 1.0), (2, 30.0, 1.0)])
    parser = argparse.ArgumentParser()
    tppo_vs_ppo.add_args(parser)
    args = parser.parse_args(["--config", "smoke", "--seeds", "1", "--target", "35",
                              "--summarize-only", "--out", str(tmp_path), "rollout.window=8"])
    res = tppo_vs_ppo.run(args)
    assert res["window"] == 8 and res["overrides"] == ["rollout.window=8"]
    assert json.loads((tmp_path / "tppo_vs_ppo_smoke.json").read_text())["window"] == 8


def test_speedup_ceiling_hand_values():
    """PPO spent 240 s decoding at occupancy 0.4 and 360 s updating and grading: a T-PPO that
    kept every slot busy and updated as cheaply per sample takes 96 + 360 s, so 600 / 456.
    With no idle slot to win back there is no speedup to have."""
    from tppo_jax.benchmarks.tppo_vs_ppo import speedup_ceiling

    ppo = lambda occ: {"time_split_s": {"rollout": 240.0, "grading": 10.0,  # noqa: E731
                                        "update": 350.0, "compile": 5.0}, "occupancy_mean": occ}
    assert speedup_ceiling(ppo(0.4)) == pytest.approx(600 / 456)
    assert speedup_ceiling(ppo(1.0)) == pytest.approx(1.0)
    assert speedup_ceiling(ppo(None)) is None
    # The paper's 2.5x needs a rollout-bound baseline: R = 3 (U + G) at occupancy 0.2.
    bound = {"time_split_s": {"rollout": 300.0, "grading": 0.0, "update": 100.0,
                              "compile": 0.0}, "occupancy_mean": 0.2}
    assert speedup_ceiling(bound) == pytest.approx(2.5)
