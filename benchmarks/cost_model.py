"""T-PPO vs PPO time-to-target from per-token costs: measured here, projected to the paper.

A training step of either method costs

    decode_steps * t_step  +  kv_reads * t_kv  +  update_tokens * t_update  +  finished * t_grade

where the counts come from replaying the rollout schedule (``replay``: every window each
slot decodes up to ``l`` tokens, the window lasts as long as its busiest slot, finished slots
take the next prompt; ``l = L`` is synchronous PPO) on a response-length distribution, and
the unit costs come from

- this machine: ``measure`` reads the per-step metrics of a T-PPO and a PPO run (e.g. the
  runs of ``tppo bench tppo-vs-ppo --config longtail``): seconds per decode step of all
  slots, per update token (a forward + backward token; a critic forward is a third of one),
  per graded sample. The model is checked against the same runs (``cpu_check``).
- an accelerator: decode steps read the weights once (HBM bandwidth) and do ``2 N`` FLOPs per
  slot, each decoded token reads its KV prefix (bandwidth), an update token is ``6 N`` FLOPs
  for the policy and again for the critic at ``--mfu``; grading is the measured CPU cost per
  sample over ``--grader-workers`` processes.

Both methods are assumed to reach the target after the same number of finished samples
(``--sample-ratio`` = PPO / T-PPO samples to target, measured on CPU when available), so the
time-to-target ratio is the ratio of seconds per finished sample. Writes
``results/cost_model.json``.

    tppo bench cost-model --runs results/runs/longtail
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import numpy as np
from tppo_jax.benchmarks.accelerator import PEAKS


def replay(lengths: np.ndarray, slots: int, window: int, max_len: int, prompt: int) -> dict:
    """Counts of one pass over ``lengths`` (response tokens per sample, in queue order).

    Returns totals: ``steps`` (windows), ``decode_steps`` (sum of each window's longest
    work), ``useful_tokens``, ``finished``, ``kv_reads`` (sum over decoded tokens of the
    context they attend to), and update tokens: the policy trains every live row and the
    critic every finished row, padded to the window's longest row (``*_padded``, what this
    trainer did before its row groups) or packed (``*_packed``: each row its own length; the
    row groups, each cut to its width bucket, come close to it).
    """
    queue = list(np.minimum(np.asarray(lengths, np.int64), max_len)[::-1])
    rem = np.array([queue.pop() if queue else 0 for _ in range(slots)], np.int64)
    prog = np.zeros(slots, np.int64)
    t = dict.fromkeys(("steps", "decode_steps", "useful_tokens", "finished", "kv_reads",
                       "policy_padded", "policy_packed", "value_padded", "value_packed"), 0)
    while rem.any():
        live = rem > 0
        work = np.minimum(window, rem)
        t["steps"] += 1
        t["decode_steps"] += int(work.max())
        t["useful_tokens"] += int(work.sum())
        t["kv_reads"] += int((work * (prompt + prog) + work * (work - 1) // 2).sum())
        prog = prog + work
        rem = rem - work
        width = prompt + int(prog[live].max())
        fin = live & (rem == 0)
        t["finished"] += int(fin.sum())
        t["policy_padded"] += int(live.sum()) * width
        t["policy_packed"] += int((prompt + prog[live]).sum())
        t["value_padded"] += int(fin.sum()) * width
        t["value_packed"] += int((prompt + prog[fin]).sum())
        for i in np.flatnonzero(fin):  # refill
            rem[i], prog[i] = (queue.pop() if queue else 0), 0
    return t


def step_costs(counts: dict, unit: dict, packed: bool) -> dict:
    """Seconds spent in each phase for ``counts`` (``replay``) at ``unit`` costs."""
    k = "packed" if packed else "padded"
    update_tokens = counts[f"policy_{k}"] * (1 + 1 / 3) + counts[f"value_{k}"]
    out = {"decode": counts["decode_steps"] * unit["t_step"] + counts["kv_reads"] * unit["t_kv"],
           "update": update_tokens * unit["t_update"],
           "grading": counts["finished"] * unit["t_grade"]}
    out["total"] = sum(out.values())
    out["per_finished_sample"] = out["total"] / max(counts["finished"], 1)
    return out


def measure(run_dir: Path, slots: int) -> dict:
    """Unit costs from a run's metrics.jsonl (medians over its steps; compile time excluded:
    the trainer reports it apart)."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward_mean" in r and "update_width" in r]
    if not steps:
        raise SystemExit(f"{run_dir}: no steps with update_width (needs this version's trainer)")
    t_step, t_upd, t_grade = [], [], []
    for r in steps:
        decode_steps = r["tokens"] / max(r["occupancy"] * slots, 1e-9)
        t_step.append(r["time_rollout_s"] / max(decode_steps, 1.0))
        w = r["update_width"]
        # Token cells the updates ran over: the row groups' (this trainer) or, in runs that
        # predate them, every row at the batch width. The critic's targets forward pass
        # (forward only, ~1/3 of forward + backward) runs at the batch width.
        policy = r.get("policy_cells", slots * w) if "pg_loss" in r else 0
        value = r.get("value_cells", r["value_rows"] * w)
        t_upd.append(r["time_update_s"] / (policy + slots * w / 3 + value))
        if r.get("finished"):
            t_grade.append(r["time_grading_s"] / r["finished"])
    return {"t_step": statistics.median(t_step), "t_kv": 0.0,
            "t_update": statistics.median(t_upd),
            "t_grade": statistics.median(t_grade) if t_grade else 0.0, "steps": len(steps)}


def accelerator_units(n_params: int, kv_bytes_per_token: int, slots: int, chips: int,
                      device: str, mfu: float, bw_eff: float, t_grade: float,
                      grader_workers: int) -> dict:
    """Unit costs on ``chips`` accelerators of kind ``device`` (bf16 weights)."""
    flops, bw = PEAKS[device]
    weights = 2 * n_params / (chips * bw * bw_eff)
    compute = 2 * n_params * slots / (chips * flops * mfu)
    return {"t_step": max(weights, compute), "t_kv": kv_bytes_per_token / (chips * bw * bw_eff),
            "t_update": 6 * n_params / (chips * flops * mfu),
            "t_grade": t_grade / grader_workers}


def lognormal_lengths(n: int, median: float, sigma: float, max_len: int, seed: int = 0
                      ) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(np.log(median), sigma, n), 16, max_len).astype(np.int64)


def _compare(lengths, slots, window, max_len, prompt, unit, packed, sample_ratio) -> dict:
    per = {}
    for name, w in (("tppo", window), ("ppo", max_len)):
        c = replay(lengths, slots, w, max_len, prompt)
        per[name] = {"counts": c, "seconds": step_costs(c, unit, packed),
                     "occupancy": c["useful_tokens"] / max(c["decode_steps"] * slots, 1)}
    t, p = (per[m]["seconds"]["per_finished_sample"] for m in ("tppo", "ppo"))
    per["time_to_target_ratio"] = p / t * sample_ratio  # PPO time / T-PPO time
    return per


def run_window(run_dir: Path, default: int) -> int:
    """The window the T-PPO run in ``run_dir`` trained with (its ``config.yaml``), so the
    CPU check replays the schedule the measured run had, whatever the config says now;
    ``default`` when the run dir holds no config."""
    from tppo_jax.config import load_config

    path = run_dir / "config.yaml"
    return load_config(path).rollout.window if path.exists() else default


def run(args: argparse.Namespace) -> dict:
    from tppo_jax.config import load_config
    from tppo_jax.plan import ARCHITECTURES

    out: dict = {"assumptions": vars(args).copy()}
    cpu = load_config(args.config)
    r = cpu.rollout
    runs = Path(args.runs)
    have = [m for m in ("tppo", "ppo") if (runs / f"{m}-seed{args.seed}" / "metrics.jsonl")
            .exists()]
    if not have:
        raise SystemExit(f"{runs}: no tppo-seed{args.seed}/ or ppo-seed{args.seed}/ run dir")
    unit_cpu = {m: measure(runs / f"{m}-seed{args.seed}", r.slots) for m in have}
    # One unit cost per phase: the mean of the runs' medians (same model and machine).
    unit = {k: statistics.fmean(u[k] for u in unit_cpu.values())
            for k in ("t_step", "t_kv", "t_update", "t_grade")}
    out["cpu_units"] = {"per_run": unit_cpu, "used": unit}
    lengths = _task_lengths(cpu, runs, args.samples)
    sample_ratio = args.sample_ratio if args.sample_ratio is not None else 1.0
    window = run_window(runs / f"tppo-seed{args.seed}", r.window)
    out["cpu_window"] = window
    cpu_pred = _compare(lengths, r.slots, window, r.max_response_len, args.cpu_prompt_len,
                        unit, False, sample_ratio)
    out["cpu_check"] = {"predicted": cpu_pred,
                        "measured": _measured(runs, args.seed) if len(have) == 2 else None}
    arch = ARCHITECTURES[args.arch]
    kv = 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * 2  # bf16 K and V
    slots = args.prompts * args.group
    acc_unit = accelerator_units(arch.n_params, kv, slots, args.chips, args.device, args.mfu,
                                 args.bw_eff, unit["t_grade"], args.grader_workers)
    big = lognormal_lengths(slots * args.batches, args.median_frac * args.L, args.sigma, args.L)
    out["paper_scale"] = {
        "arch": args.arch, "params": arch.n_params, "kv_bytes_per_token": kv,
        "slots": slots, "L": args.L, "window": args.l, "units": acc_unit,
        "lengths": _stats(big),
        **{mode: _compare(big, slots, args.l, args.L, args.prompt_len, acc_unit,
                          mode == "packed", sample_ratio) for mode in ("padded", "packed")},
    }
    # How the projection moves with the length distribution (the least known input).
    out["paper_scale"]["sensitivity"] = {
        f"median_frac={f}": {mode: _compare(
            lognormal_lengths(slots * args.batches, f * args.L, args.sigma, args.L), slots,
            args.l, args.L, args.prompt_len, acc_unit, mode == "packed",
            sample_ratio)["time_to_target_ratio"] for mode in ("padded", "packed")}
        for f in (0.0625, 0.125, 0.25, 0.4)}
    _strip_counts(out)
    path = Path(args.out) / "cost_model.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    print(json.dumps({"cpu_predicted_ratio": cpu_pred["time_to_target_ratio"],
                      "cpu_measured": out["cpu_check"]["measured"],
                      "paper_padded": out["paper_scale"]["padded"]["time_to_target_ratio"],
                      "paper_packed": out["paper_scale"]["packed"]["time_to_target_ratio"]},
                     indent=2))
    return out


def _measured(runs: Path, seed: int) -> dict:
    """Seconds per finished sample of the measured runs (train time, compile excluded)."""
    out = {}
    for m in ("tppo", "ppo"):
        rows = [json.loads(x) for x in (runs / f"{m}-seed{seed}" / "metrics.jsonl")
                .read_text().splitlines()]
        steps = [r for r in rows if "reward_mean" in r]
        secs = sum(r["time_rollout_s"] + r["time_grading_s"] + r["time_update_s"] for r in steps)
        out[m] = secs / max(sum(r.get("finished", 0) for r in steps), 1)
    out["ratio"] = out["ppo"] / out["tppo"]
    return out


def _task_lengths(cfg, runs: Path, n: int) -> np.ndarray:
    """The CPU task's solution lengths in warm-start tokens (queue order)."""
    from tppo_jax.data.run_data import synthetic_task
    from tppo_jax.models.tokenizer import Tokenizer

    tok_file = next(runs.glob("warmstart-*/tokenizer.model"))
    tok = Tokenizer.load(tok_file)
    return np.array([len(tok.encode(e.solution)) + 1 for e in synthetic_task(cfg).sample(n)])


def _stats(x: np.ndarray) -> dict:
    return {"median": float(np.median(x)), "p90": float(np.percentile(x, 90)),
            "p99": float(np.percentile(x, 99)), "max": int(x.max()), "mean": float(x.mean())}


def _strip_counts(out: dict) -> None:
    """Counts stay (they explain the seconds) but as plain ints."""
    for part in (out["cpu_check"]["predicted"], out["paper_scale"]["padded"],
                 out["paper_scale"]["packed"]):
        for m in ("tppo", "ppo"):
            part[m]["counts"] = {k: int(v) for k, v in part[m]["counts"].items()}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default="longtail", help="the CPU runs' config")
    p.add_argument("--runs", default="results/runs/longtail",
                   help="folder with tppo-seed<N>/ and ppo-seed<N>/ run dirs (and the warm-start)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--samples", type=int, default=2000, help="CPU task samples to replay")
    p.add_argument("--cpu-prompt-len", type=int, default=40, help="the CPU task's prompt tokens")
    p.add_argument("--sample-ratio", type=float, default=None,
                   help="PPO / T-PPO finished samples to target (default 1: equal efficiency)")
    p.add_argument("--arch", default="qwen2.5-32b")
    p.add_argument("--device", default="TPU v5p", choices=sorted(PEAKS))
    p.add_argument("--chips", type=int, default=256)
    p.add_argument("--mfu", type=float, default=0.4, help="update (and decode compute) MFU")
    p.add_argument("--bw-eff", type=float, default=0.7, help="achieved / peak HBM bandwidth")
    p.add_argument("--grader-workers", type=int, default=32 * 64)
    p.add_argument("--prompts", type=int, default=512)
    p.add_argument("--group", type=int, default=16)
    p.add_argument("--batches", type=int, default=4, help="steps' worth of samples replayed")
    p.add_argument("--L", type=int, default=24576)
    p.add_argument("--l", type=int, default=8192)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--median-frac", type=float, default=0.125,
                   help="median response length / L of the log-normal lengths")
    p.add_argument("--sigma", type=float, default=0.9)
    p.add_argument("--out", default="results")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    add_args(parser)
    run(parser.parse_args())
