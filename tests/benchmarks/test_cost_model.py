"""The cost model's schedule replay, unit costs and projection, on hand-computed values."""

import json

import numpy as np
import pytest

from tppo_jax.benchmarks.cost_model import explain_gap
from tppo_jax.benchmarks.costs import (
    Counts,
    Units,
    accelerator_units,
    compare,
    load_compiled,
    matmul_params,
    projection,
    replay,
    speedup_at,
    step_costs,
)
from tppo_jax.plan import Arch


def test_replay_hand_counts_truncated_and_synchronous():
    # One slot, window 2, prompt 1: sample 3 then sample 5 (contexts 1..3 and 1..5).
    t = replay(np.array([3, 5]), slots=1, window=2, max_len=8, prompt=1).total
    assert t.steps == 5 and t.decode_steps == 8 and t.useful_tokens == 8
    assert t.finished == 2 and t.kv_reads == 6 + 15
    assert t.policy_padded == 3 + 4 + 3 + 5 + 6 and t.value_padded == 4 + 6
    # Attention counts: sum of T (T + 1) over the trained rows.
    assert t.policy_sq_packed == 3 * 4 + 4 * 5 + 3 * 4 + 5 * 6 + 6 * 7
    assert t.value_sq_packed == 4 * 5 + 6 * 7
    # Two slots, one window of L: PPO waits for the longest (5) and pads the batch to it.
    p = replay(np.array([3, 5]), slots=2, window=8, max_len=8, prompt=1).total
    assert p.steps == 1 and p.decode_steps == 5 and p.kv_reads == 21
    assert p.policy_padded == 12 and p.policy_packed == 10 and p.value_packed == 10
    assert p.policy_sq_padded == 2 * 6 * 7 and p.policy_sq_packed == 4 * 5 + 6 * 7
    unit = Units(t_step=1.0, t_kv=0.0, t_policy=0.5, t_value=0.5, t_attn=0.0, t_reshard=0.0,
                 t_grade=2.0)
    s = step_costs(p, unit, packed=False)
    assert s["decode"] == 5 and s["update"] == pytest.approx(0.5 * (12 * 4 / 3 + 12))
    assert s["per_finished_sample"] == pytest.approx(s["total"] / 2) and s["grading"] == 4


def test_step_costs_charge_attention_and_the_reshard_per_step():
    c = Counts(steps=3, finished=2, policy_packed=10, value_packed=4, policy_sq_packed=60,
               value_sq_packed=20)
    u = Units(t_step=0.0, t_kv=0.0, t_policy=1.0, t_value=2.0, t_attn=0.1, t_reshard=5.0,
              t_grade=0.0)
    s = step_costs(c, u, packed=True)
    # policy 10 x 4/3, critic 4 x 2, attention (60 x (1 + 2/9) + 20) x 0.1 (the targets pass
    # is one attention forward, 2 of the 9 a trained row costs); 3 steps x 5 s reshard.
    attn = (60 * 11 / 9 + 20) * 0.1
    assert s["update"] == pytest.approx(40 / 3 + 8 + attn)
    assert s["reshard"] == 15 and s["total"] == pytest.approx(40 / 3 + 8 + attn + 15)


def test_steady_state_occupancy_without_the_drain():
    # Two slots, window 2, queue [2, 4, 2, 2, 2]: w1 runs [2, 2] (slot 0 done, refilled);
    # w2 runs [2, 2] (both done, refilled with the last two); w3 runs [2, 2]: every window
    # starts with both slots busy, so all three are steady and nothing drains.
    r = replay(np.array([2, 4, 2, 2, 2]), slots=2, window=2, max_len=8, prompt=0)
    assert r.steady.steps == 3 and r.drain.steps == 0
    assert r.steady.occupancy(2) == 1.0
    # A long sample at the end of the queue: the drain is the windows with an idle slot.
    r = replay(np.array([6, 2]), slots=2, window=2, max_len=8, prompt=0)
    # w1: [6, 2] busy -> work [2, 2] (slot1 done, queue empty); w2, w3: slot 1 idle.
    assert (r.steady.steps, r.drain.steps) == (1, 2)
    assert r.steady.occupancy(2) == 1.0 and r.drain.occupancy(2) == 0.5
    assert r.total.occupancy(2) == pytest.approx(8 / 12)


def test_steady_state_at_paper_scale_is_the_issues_047():
    """At 8192 slots, L = 24k, l = 8k and log-normal lengths (median L/8, sigma 0.9), the
    steady state holds T-PPO at ~0.47 occupancy and ~2.56x fewer decode steps per sample than
    PPO; a 4-batch replay counting its drain gave 0.31."""
    from tppo_jax.benchmarks.costs import lognormal_lengths

    lengths = lognormal_lengths(8192 * 8, 3072, 0.9, 24576)
    u = Units(1.0, 0.0, 1e-6, 1e-6, 0.0, 0.0, 0.0)
    c = compare(lengths, 8192, 8192, 24576, 512, u, packed=True)
    assert c["tppo"]["occupancy"] == pytest.approx(0.47, abs=0.01)
    assert c["decode_step_ratio"] == pytest.approx(2.56, abs=0.05)
    short = replay(lengths[:8192 * 4], 8192, 8192, 24576, 512).total
    assert short.occupancy(8192) == pytest.approx(0.31, abs=0.01)


def test_a_replay_too_short_for_a_steady_state_is_refused():
    u = Units(1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0)
    with pytest.raises(SystemExit, match="no steady-state window"):
        compare(np.array([4]), slots=2, window=2, max_len=8, prompt=0, unit=u, packed=True)


def test_projection_is_the_share_formula():
    ppo = {"decode": 6.0, "total": 10.0, "per_finished_sample": 1.0}
    tppo = {"decode": 2.0, "total": 6.0, "per_finished_sample": 0.6}
    p = projection(ppo, tppo)
    # f = 0.6; r_d = 0.6 / (2/6 * 0.6) = 3; r_u = (4/6 * 0.6) / (0.4 * 1.0) = 1.
    assert p["f"] == pytest.approx(0.6) and p["r_d"] == pytest.approx(3.0)
    assert p["r_u"] == pytest.approx(1.0)
    assert p["speedup"] == pytest.approx(1 / (0.6 / 3 + 0.4 * 1.0)) == pytest.approx(1 / 0.6)
    assert speedup_at(0.9, 3.0, 1.0) == pytest.approx(1 / 0.4)


ARCH = Arch("toy", vocab_size=100, hidden_size=10, intermediate_size=20, num_layers=2,
            num_heads=2, num_kv_heads=1, head_dim=4, qkv_bias=False, tie_embeddings=False)


def test_matmul_params_leave_out_the_embedding_lookup_and_the_critics_lm_head():
    n = ARCH.n_params
    # Untied: embedding 100 x 10 (a lookup) and the LM head 10 x 100 (a matmul) each 1000.
    pol, val = matmul_params(ARCH)
    assert pol == n - 1000
    assert val == n - 2000 + 10 + 1  # no LM head; the scalar value head (10 + bias)
    tied = Arch(**{**ARCH.__dict__, "tie_embeddings": True})
    pol_t, val_t = matmul_params(tied)
    assert pol_t == tied.n_params and val_t == tied.n_params - 1000 + 11


def test_accelerator_units_are_roofline_terms_with_floor_reshard_and_attention():
    slots, chips, tp = 8, 4, 2
    u = accelerator_units(ARCH, slots=slots, chips=chips, device="H100", mfu=0.5, bw_eff=1.0,
                          t_grade=1.0, grader_workers=4, decode_tp=tp, step_floor_s=0.01,
                          ici_bw=1e9)
    flops, bw = 989e12, 3.35e12
    pol, val = matmul_params(ARCH)
    weights = 2 * pol / (tp * bw)  # each decode replica reads its copy once per step
    compute = 2 * pol * slots / (chips * flops * 0.5)
    assert u.t_step == pytest.approx(0.01 + max(weights, compute))
    kv = 2 * 2 * 1 * 4 * 2
    assert u.t_kv == pytest.approx(kv / (chips * bw))
    assert u.t_policy == pytest.approx(6 * pol / (chips * flops * 0.5))
    assert u.t_value == pytest.approx(6 * val / (chips * flops * 0.5))
    # forward 2 + flash backward 5 + remat 2 per layer x d x T (T + 1)
    assert u.t_attn == pytest.approx(9 * 2 * 2 * 4 / (chips * flops * 0.5))
    # Each chip receives its decode shard (2 pol / tp bytes) less what it holds (tp / chips).
    assert u.t_reshard == pytest.approx(2 * pol / tp * (1 - tp / chips) / 1e9)
    assert u.t_grade == 0.25


def test_qwen32b_miscounts_match_the_audit():
    """6 N counted the input embedding (+2.4% on the policy) and an LM head on the critic
    (+2.4% more); attention is ~9% of the update at the paper's lengths."""
    from tppo_jax.plan import ARCHITECTURES

    a = ARCHITECTURES["qwen2.5-32b"]
    pol, val = matmul_params(a)
    assert a.n_params / pol - 1 == pytest.approx(0.0243, abs=0.001)
    assert a.n_params / val - 1 == pytest.approx(0.0498, abs=0.001)
    # A row of 10k tokens: attention 6 layers d T (T + 1) against 6 N_mm T.
    attn = 6 * a.num_layers * a.num_heads * a.head_dim * 10_000 * 10_001
    assert attn / (attn + 6 * pol * 10_000) == pytest.approx(0.093, abs=0.002)


def test_compiled_units_loader_on_a_hand_json(tmp_path):
    path = tmp_path / "compiled.json"
    path.write_text(json.dumps({"config": "toy", "topology": "v5p-8", "programs": {
        "prefill": {"flops": 1.0, "bytes_accessed": 1.0},
        "decode_window": {"flops": 8e9, "bytes_accessed": 5e9, "kv_bytes": 1e9, "slots": 16,
                          "decode_steps": 2, "peak_bytes": 9},
        "policy_train_step": {"flops": 6e12, "bytes_accessed": 3e9, "tokens": 1000},
        "value_train_step": {"flops": 3e12, "bytes_accessed": 1e9, "tokens": 1000}}}))
    c = load_compiled(path)
    assert c.decode_flops_per_token == 8e9 / (2 * 16)
    assert c.decode_bytes_per_step == (5e9 - 1e9) / 2
    assert c.update_flops_per_token == 6e9 and c.update_bytes_per_token == 3e6
    assert c.value_flops_per_token == 3e9 and c.value_bytes_per_token == 1e6
    u = accelerator_units(ARCH, slots=16, chips=4, device="H100", mfu=0.5, bw_eff=1.0,
                          t_grade=0.0, grader_workers=1, compiled=c, reshard_s=0.0)
    flops, bw = 989e12, 3.35e12
    # The decode step is its matmuls (not the compiled program's attention over the whole
    # page table); the update's matmuls are compiled, its attention analytic.
    pol, _ = matmul_params(ARCH)
    assert u.t_step == pytest.approx(max(2 * pol / 8 / bw, 2 * pol / 4 * 16 / (flops * 0.5)))
    assert u.t_policy == pytest.approx(max(6e9 / (flops * 0.5), 3e6 / bw))
    assert u.t_value == pytest.approx(3e9 / (flops * 0.5))
    assert u.t_attn == pytest.approx(9 * 2 * 2 * 4 / (4 * flops * 0.5))


def test_compiled_units_loader_reads_the_compile_paths_program_list(tmp_path):
    """``tppo_jax.compile``'s records: a list with ``kind``; update buckets as rows x width,
    summed; prefill, targets, optimizer applies and uncompiled programs skipped."""
    path = tmp_path / "compiled_toy_v5p-8.json"
    progs = [
        {"name": "targets_finish", "kind": "targets", "rows": 8, "width": 64, "flops": 1.0,
         "bytes_accessed": 1.0, "compiled": True},
        {"name": "policy_update[w=32]", "kind": "policy_update", "rows": 4, "width": 32,
         "flops": 1e6, "bytes_accessed": 1e4, "compiled": True},
        {"name": "policy_update[w=64]", "kind": "policy_update", "rows": 2, "width": 64,
         "flops": 3e6, "bytes_accessed": 3e4, "compiled": True},
        {"name": "policy_update[w=128]", "kind": "policy_update", "rows": 1, "width": 128,
         "compiled": False, "fits_alone": False},
        {"name": "policy_apply", "kind": "policy_apply", "flops": 9e9, "bytes_accessed": 9e9,
         "compiled": True},
        {"name": "value_update[w=32]", "kind": "value_update", "rows": 4, "width": 32,
         "flops": 5e5, "bytes_accessed": 2e3, "compiled": True},
        {"name": "rollout_prefill[w=96]", "kind": "rollout", "slots": 8, "width": 96,
         "flops": 7.0, "bytes_accessed": 7.0, "compiled": True},
        {"name": "rollout_window[l=16]", "kind": "rollout", "slots": 8, "window": 16,
         "flops": 8e4, "bytes_accessed": 5e5, "compiled": True}]
    path.write_text(json.dumps({"config": "toy", "programs": progs}))
    c = load_compiled(path)
    assert c.update_flops_per_token == pytest.approx(4e6 / 256)
    assert c.update_bytes_per_token == pytest.approx(4e4 / 256)
    assert c.value_flops_per_token == pytest.approx(5e5 / 128)
    assert c.decode_flops_per_token == 1e4 and c.decode_bytes_per_step == 5e5


def test_compiled_loader_rejects_a_file_without_the_programs(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"programs": {"prefill": {"flops": 1, "bytes_accessed": 1}}}))
    with pytest.raises(SystemExit, match="needs a compiled \\*decode\\*"):
        load_compiled(path)
    path.write_text(json.dumps({"programs": {"decode": {"flops": 1, "bytes_accessed": 1},
                                             "train": {"flops": 1, "bytes_accessed": 1}}}))
    with pytest.raises(SystemExit, match="lacks"):
        load_compiled(path)


def test_gap_swaps_in_one_measured_term_at_a_time():
    pred = {"projection": {"f": 0.4, "r_d": 2.0, "r_u": 1.2, "speedup": speedup_at(0.4, 2, 1.2)}}
    meas = {"projection": {"f": 0.4, "r_d": 1.5, "r_u": 1.5, "speedup": speedup_at(0.4, 1.5,
                                                                                    1.5)}}
    for m in ("tppo", "ppo"):
        pred[m] = {"seconds": {"decode": 1.0, "update": 1.0, "grading": 0.0},
                   "counts": {"finished": 1}}
        meas[m] = {"decode": 1.0, "update": 1.0, "grading": 0.0}
    g = explain_gap(pred, meas)
    assert g["with_measured_r_d"] == pytest.approx(1 / (0.4 / 1.5 + 0.6 * 1.2))
    assert g["with_measured_r_u"] == pytest.approx(1 / (0.4 / 2 + 0.6 * 1.5))
    assert g["with_measured_f"] == pytest.approx(pred["projection"]["speedup"])


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


def test_paper_scale_takes_its_units_from_a_compiled_json(tmp_path):
    """``--compiled`` feeds the update's matmuls; the decode step is matmuls + the floor, the
    attention analytic; each method's occupancy is the page replay's (both on demand)."""
    import argparse

    from tppo_jax.benchmarks.cost_model import add_args, paper_scale
    from tppo_jax.plan import ARCHITECTURES

    path = tmp_path / "compiled.json"
    path.write_text(json.dumps({"programs": {
        "decode": {"flops": 2 * 32e9 * 64 / 4, "bytes_accessed": 64e9 / 4, "slots": 64},
        "policy_update": {"flops": 6 * 32e9 * 1000 / 4, "bytes_accessed": 1e9, "tokens": 1000}}}))
    replay = tmp_path / "page_replay.json"
    replay.write_text(json.dumps({"runs": {
        f"{m}/{a}/shipped": {"steady": {"occupancy": occ}}
        for m, a, occ in (("tppo", "demand", 0.4), ("ppo", "demand", 0.2),
                          ("tppo", "window", 0.2), ("ppo", "window", 0.02))}}))
    p = argparse.ArgumentParser()
    add_args(p)
    args = p.parse_args(["--prompts", "8", "--group", "8", "--chips", "4", "--batches", "4",
                         "--L", "256", "--l", "64", "--prompt-len", "16",
                         "--compiled", str(path), "--page-replay", str(replay),
                         "--sensitivity-medians"])
    out = paper_scale(args, ARCHITECTURES["qwen2.5-32b"], t_grade=0.0, sample_ratio=1.0)
    assert str(path) in out["units_from"] and out["units"]["t_attn"] > 0
    flops = 459e12 * 0.4
    assert out["units"]["t_policy"] == pytest.approx(6 * 32e9 / 4 / flops)
    h = out["headline"]
    assert h["speedup"] == pytest.approx(1 / (h["f"] / h["r_d"] + (1 - h["f"]) * h["r_u"]))
    assert h["occupancy"] == {"tppo": pytest.approx(0.4, rel=1e-3),
                              "ppo": pytest.approx(0.2, rel=1e-3)}
    assert [s["f"] for s in out["published_shares"]] == [0.41, 0.50, 0.70, 0.60, 0.64]
    # the decode step: the weights read once per replica, or its matmuls, plus the floor
    assert out["units"]["t_step"] == pytest.approx(
        3e-3 + max(2 * 31985308672 / 8 / (2765e9 * 0.7), 2 * 31985308672 * 64 / 4 / flops))
    assert out["decode_step_s"]["compiled program (not used)"] > 0


def test_compiled_units_refuse_scanned_layers(tmp_path):
    """XLA counts a loop body once: a scanned-layer program's FLOPs are one layer's."""
    path = tmp_path / "compiled.json"
    path.write_text(json.dumps({"config": "toy", "model": {"scanned_layers": True},
                                "programs": []}))
    with pytest.raises(SystemExit, match="--unroll-layers"):
        load_compiled(path)


def _small_compile(layers: int, flops: dict, nbytes: dict) -> dict:
    """A ``tppo plan --compile --unroll-layers --layers N`` report of a 10-layer model."""
    return {"config": "toy", "topology": "v5p-8", "chips": 4,
            "model": {"layers": 10, "num_layers_compiled": layers, "scanned_layers": False},
            "live": {"kv_cache": 1}, "fits": True, "compile_s": 1.0,
            "programs": [{"name": n, "kind": k, "compiled": True, "peak": 7, "fits": True,
                          "flops": flops[n], "bytes_accessed": nbytes[n], "compile_s": 0.5,
                          **meta}
                         for n, k, meta in (("rollout_window[l=8]", "rollout",
                                             {"slots": 4, "decode_steps": 1, "kv_bytes": 0}),
                                            ("policy_update[w=16]", "policy_update",
                                             {"rows": 2, "width": 16, "tokens": 32}))]}


def test_compiled_units_extrapolate_two_small_compiles_per_layer(tmp_path):
    """x(L) = x(N1) + (L - N1) (x(N2) - x(N1)) / (N2 - N1) per program, the memory figures
    dropped; ``load_compiled`` reads the result (and refuses a lone small compile)."""
    from tppo_jax.benchmarks.compiled_units import extrapolate

    pol, win = "policy_update[w=16]", "rollout_window[l=8]"
    a = _small_compile(2, {pol: 300.0, win: 40.0}, {pol: 1000.0, win: 80.0})
    b = _small_compile(4, {pol: 500.0, win: 60.0}, {pol: 1400.0, win: 100.0})
    out = extrapolate(b, a, ("l4.json", "l2.json"))  # either order
    assert out["model"]["extrapolated_from"] == [2, 4]
    assert out["model"]["scanned_layers"] is False and out["sources"] == ["l2.json", "l4.json"]
    p = {r["name"]: r for r in out["programs"]}
    # 10 layers: 300 + 8 * 100 = 1100; 1000 + 8 * 200 = 2600; 40 + 8 * 10 = 120; 80 + 8 * 10
    assert (p[pol]["flops"], p[pol]["bytes_accessed"]) == (1100.0, 2600.0)
    assert (p[win]["flops"], p[win]["bytes_accessed"]) == (120.0, 160.0)
    assert p[pol]["flops_per_layer"] == 100.0 and p[pol]["tokens"] == 32
    assert not {"peak", "fits"} & set(p[pol]) and "live" not in out and "memory" in out
    path = tmp_path / "units.json"
    path.write_text(json.dumps(out))
    c = load_compiled(path)
    assert c.update_flops_per_token == 1100.0 / 32 and c.decode_flops_per_token == 120.0 / 4
    assert c.decode_bytes_per_step == 160.0
    lone = tmp_path / "l2.json"
    lone.write_text(json.dumps(a))
    with pytest.raises(SystemExit, match="compiled-units"):
        load_compiled(lone)
    with pytest.raises(SystemExit, match="two layer counts"):
        extrapolate(a, a)
