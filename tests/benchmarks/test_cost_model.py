"""The cost model's schedule replay, on hand-computed counts."""

import numpy as np
import pytest
from tppo_jax.benchmarks.cost_model import accelerator_units, replay, step_costs


def test_replay_hand_counts_truncated_and_synchronous():
    # One slot, window 2, prompt 1: sample 3 then sample 5 (contexts 1..3 and 1..5).
    t = replay(np.array([3, 5]), slots=1, window=2, max_len=8, prompt=1)
    assert t["steps"] == 5 and t["decode_steps"] == 8 and t["useful_tokens"] == 8
    assert t["finished"] == 2 and t["kv_reads"] == 6 + 15
    assert t["policy_padded"] == 3 + 4 + 3 + 5 + 6 and t["value_padded"] == 4 + 6
    # Two slots, one window of L: PPO waits for the longest (5) and pads the batch to it.
    p = replay(np.array([3, 5]), slots=2, window=8, max_len=8, prompt=1)
    assert p["steps"] == 1 and p["decode_steps"] == 5 and p["kv_reads"] == 21
    assert p["policy_padded"] == 12 and p["policy_packed"] == 10 and p["value_packed"] == 10
    unit = {"t_step": 1.0, "t_kv": 0.0, "t_update": 0.5, "t_grade": 2.0}
    s = step_costs(p, unit, packed=False)
    assert s["decode"] == 5 and s["update"] == pytest.approx(0.5 * (12 * 4 / 3 + 12))
    assert s["per_finished_sample"] == pytest.approx(s["total"] / 2) and s["grading"] == 4


def test_accelerator_units_are_roofline_terms():
    u = accelerator_units(10**9, 1000, slots=8, chips=2, device="H100", mfu=0.5, bw_eff=1.0,
                          t_grade=1.0, grader_workers=4)
    flops, bw = 989e12, 3.35e12
    assert u["t_step"] == pytest.approx(max(2e9 / (2 * bw), 2e9 * 8 / (2 * flops * 0.5)))
    assert u["t_kv"] == pytest.approx(1000 / (2 * bw))
    assert u["t_update"] == pytest.approx(6e9 / (2 * flops * 0.5)) and u["t_grade"] == 0.25


def test_cpu_check_replays_the_window_the_measured_run_had(tmp_path):
    """The CPU check replays the T-PPO run's own window (its ``config.yaml``), not the
    config's current one; without a config in the run dir, the given default."""
    from tppo_jax.benchmarks.cost_model import run_window

    from tppo_jax.config import load_config

    run = tmp_path / "tppo-seed0"
    run.mkdir()
    assert run_window(run, 128) == 128
    (run / "config.yaml").write_text(load_config("longtail", ["rollout.window=64"]).to_yaml())
    assert run_window(run, 128) == 64
