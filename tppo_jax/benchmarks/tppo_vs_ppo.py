"""T-PPO (window l) vs synchronous PPO (l = L), side by side on the same task, model and seeds.

Each (method, seed) run trains until held-out accuracy (avg@k sampled) reaches ``--target``
(percent) or ``--budget-s`` seconds of training wall-clock pass (held-out evals excluded from
the clock), evaluated every ``--eval-every`` steps and/or ``--eval-every-s`` seconds of
training (the same time grid for both methods, whose steps differ in length). Both methods
start from the same warm-started policy. Writes
``results/tppo_vs_ppo.json`` for the default config, ``results/tppo_vs_ppo_<config>.json``
otherwise (per seed and median: ``time_to_target_s`` per method and ``speedup``; rollout
throughput as finished samples and useful -- finished -- tokens per second of rollout, and
``throughput_ratio`` = T-PPO / PPO finished samples per second; occupancy; the step time split
into rollout / grading / update / compile; ``speedup_ceiling``, the most any T-PPO could gain
over the PPO run on this machine; the task's solution-length distribution in tokens)
and the matching PNG (held-out accuracy vs training wall-clock).

    tppo bench tppo-vs-ppo --seeds 3 --target 60 --budget-s 600
    tppo bench tppo-vs-ppo --config longtail --seeds 3 --target 30 --budget-s 1800

``--jobs 2`` trains a seed's two runs side by side, each on a core of its own; ``--seed S
--method M`` trains just that run; ``--summarize-only`` then builds the JSON and PNG from all
the run dirs. ``--sweep 36,38,40`` adds the time to each of several targets.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
from pathlib import Path

from tppo_jax.benchmarks.side_by_side import (
    METHODS,
    Job,
    method_overrides,
    run_jobs,
    train_command,
    warmstart_once,
)

PHASES = ("rollout", "grading", "update", "compile")


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def summarize_run(run_dir: Path, target: float, slots: int | None = None) -> dict:
    """Time/steps to target and throughput from a run's metrics.jsonl (None when never
    reached). ``slots`` recovers finished counts from runs that logged only the fraction."""
    rows = _rows(run_dir)
    steps = [r for r in rows if "reward_mean" in r]
    evals = [r for r in rows if "eval_accuracy" in r]
    hit = next((r for r in evals if r["eval_accuracy"] >= target), None)
    train_time = {r["step"]: r["train_time_s"] for r in steps}
    last = evals[-1] if evals else {}
    fin = [r.get("finished", round(r["finished_frac"] * (slots or 0))) for r in steps]
    useful = sum(f * r["response_len_mean"] for f, r in zip(fin, steps, strict=True))
    split = {k: float(sum(r.get(f"time_{k}_s", 0.0) for r in steps)) for k in PHASES}
    roll = max(split["rollout"], 1e-9)
    wall = steps[-1]["train_time_s"] if steps else 0.0
    return {
        "budget_s": _run_budget(run_dir),
        "time_to_target_s": train_time.get(hit["step"]) if hit else None,
        "steps_to_target": hit["step"] if hit else None,
        # Sample efficiency apart from speed: speedup = PPO's samples to target / T-PPO's x
        # T-PPO's finished samples per training-second / PPO's.
        "samples_to_target": (int(sum(f for f, r in zip(fin, steps, strict=True)
                                      if r["step"] <= hit["step"])) if hit else None),
        "final_eval_accuracy": last.get("eval_accuracy"),
        # The last held-out eval in full: sampled avg@k and pass@k, and greedy.
        "final_eval": {k.removeprefix("eval_"): v for k, v in last.items()
                       if k.startswith("eval_") and isinstance(v, (int, float))},
        "steps": len(steps),
        "train_time_s": wall,
        "tokens_generated": int(sum(r["tokens"] for r in steps)),
        "finished_samples": int(sum(fin)),
        "finished_per_s": sum(fin) / roll,  # per second of rollout (compile excluded)
        "useful_tokens_per_s": useful / roll,  # tokens of finished responses, same clock
        "finished_per_wall_s": sum(fin) / max(wall, 1e-9),
        "occupancy_mean": statistics.fmean(r["occupancy"] for r in steps) if steps else None,
        "response_len_mean": statistics.fmean(r["response_len_mean"] for r in steps
                                              if r["response_len_mean"]) if any(fin) else None,
        "response_len_max": max((r["response_len_max"] for r in steps), default=None),
        "time_split_s": split,
        "step_time_median_s": {k: statistics.median(r.get(f"time_{k}_s", 0.0) for r in steps)
                               for k in PHASES} if steps else None,
        "compiles": int(sum(r.get("compiles", 0) for r in steps)),
        "curve": _before(run_dir) + [(train_time.get(r["step"], 0.0), r["eval_accuracy"])
                                     for r in evals],
    }


def time_to(curve: list[tuple[float, float]], target: float) -> float | None:
    """Training wall-clock of the first point of ``curve`` ((time, accuracy) pairs, in
    order) at or above ``target``; None when none is."""
    return next((t for t, acc in curve if acc >= target), None)


def target_sweep(seeds: dict, targets: list[float]) -> dict:
    """Per target: each method's median time to it over seeds and the median speedup (PPO /
    T-PPO, over the seeds where both reached it), with the number of seeds that did. One
    noisy eval can cross a single target early; the sweep shows whether the speedup holds
    across targets."""
    out = {}
    for target in targets:
        times = {m: [time_to(s[m]["curve"], target) for s in seeds.values()] for m in METHODS}
        both = [p / t for t, p in zip(times["tppo"], times["ppo"], strict=True) if t and p]
        out[f"{target:g}"] = {
            **{f"time_to_target_s_{m}": _median([t for t in times[m] if t is not None])
               for m in METHODS},
            **{f"reached_{m}": sum(t is not None for t in times[m]) for m in METHODS},
            "speedup": _median(both), "seeds_both_reached": len(both)}
    return out


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _run_budget(run_dir: Path) -> float | None:
    """The run's own ``train.time_budget_s`` (its ``config.yaml``), not this call's flag."""
    import yaml

    path = run_dir / "config.yaml"
    return yaml.safe_load(path.read_text())["train"]["time_budget_s"] if path.exists() else None


def _before(run_dir: Path) -> list[tuple[float, float]]:
    path = run_dir / "eval_before.json"
    return [(0.0, json.loads(path.read_text())["accuracy"])] if path.exists() else []


def _out_name(config: str) -> str:
    stem = Path(config).stem
    return "tppo_vs_ppo" if stem == "default" else f"tppo_vs_ppo_{stem}"


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if (a and b) else None


def run(args: argparse.Namespace) -> dict:
    from tppo_jax.config import load_config

    out_dir = Path(args.out)
    name = _out_name(args.config)
    # With the user's overrides: the window T-PPO ran with and the L that PPO's window is.
    base = load_config(args.config, args.overrides)
    L = base.rollout.max_response_len
    results: dict = {"target": args.target, "budget_s": args.budget_s, "config": args.config,
                     "overrides": args.overrides, "L": L, "window": base.rollout.window,
                     "slots": base.rollout.slots, "seeds": {}}
    runs = out_dir / "runs" / ("" if name == "tppo_vs_ppo" else Path(args.config).stem)
    if (args.seed is not None or args.method is not None) and not args.summarize_only:
        # Just the selected run(s); the summary waits for --summarize-only.
        seeds = range(args.seeds) if args.seed is None else [args.seed]
        for seed in seeds:
            for method in (METHODS if args.method is None else [args.method]):
                _train_run(args, L, seed, method, runs / f"{method}-seed{seed}")
        print(f"trained {args.method or 'both methods'} for seed "
              f"{'all' if args.seed is None else args.seed}; once every run is done: "
              f"tppo bench tppo-vs-ppo --config {args.config} --seeds {args.seeds} "
              f"--target T --summarize-only")
        return results
    trained = args.summarize_only  # else train here (--jobs > 1: all of them first)
    if not trained and args.jobs > 1:
        _train_side_by_side(args, L, runs)
        trained = True
    for seed in range(args.seeds):
        per = {}
        for method in METHODS:
            run_dir = runs / f"{method}-seed{seed}"
            if not trained:
                _train_run(args, L, seed, method, run_dir)
            per[method] = summarize_run(run_dir, args.target, base.rollout.slots)
        t, p = per["tppo"]["time_to_target_s"], per["ppo"]["time_to_target_s"]
        per["speedup"] = _ratio(p, t)
        per["speedup_bounds"] = _speedup_bounds(per["tppo"], per["ppo"])
        per["throughput_ratio"] = _ratio(per["tppo"]["finished_per_s"],
                                         per["ppo"]["finished_per_s"])
        per["speedup_ceiling"] = speedup_ceiling(per["ppo"])
        results["seeds"][str(seed)] = per
        print(f"seed {seed}: T-PPO {t} s, PPO {p} s, speedup {per['speedup']}, "
              f"throughput ratio {per['throughput_ratio']}")
    if args.summarize_only:  # the budget the runs had, not this call's --budget-s
        budgets = {r[m]["budget_s"] for r in results["seeds"].values() for m in METHODS}
        results["budget_s"] = budgets.pop() if len(budgets) == 1 else sorted(
            b for b in budgets if b is not None)
    results["median"] = _medians(results["seeds"])
    if args.sweep:
        results["target_sweep"] = target_sweep(results["seeds"], args.sweep)
    results["lengths"] = _length_report(runs, load_config(args.config))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(results, indent=2))
    _plot(results, out_dir / f"{name}.png")
    print(json.dumps(results["median"], indent=2))
    return results


def _overrides(args: argparse.Namespace, L: int, seed: int, method: str) -> list[str]:
    """The config overrides of one (method, seed) run."""
    return [f"train.seed={seed}", f"train.eval_every={args.eval_every}",
            f"train.eval_every_s={args.eval_every_s}",
            f"train.target_accuracy={args.target}", f"train.time_budget_s={args.budget_s}",
            f"train.steps={args.max_steps}", *args.overrides, *method_overrides(method, L)]


def _train_run(args: argparse.Namespace, L: int, seed: int, method: str, run_dir: Path) -> None:
    """One (method, seed) run from scratch (its old run dir removed), to target or budget."""
    from tppo_jax.config import load_config
    from tppo_jax.trainer.trainer import train

    cfg = load_config(args.config, _overrides(args, L, seed, method))
    if run_dir.exists():
        shutil.rmtree(run_dir)
    train(cfg, run_dir, progress=not args.no_progress)


def _train_side_by_side(args: argparse.Namespace, L: int, runs: Path) -> None:
    """Every (seed, method) run, ``--jobs`` at a time on a core each: a seed's T-PPO and PPO
    runs together, so both clocks ran on equal, unshared cores. The warm-start first, once."""
    warmstart_once(args.config, args.overrides, runs, progress=not args.no_progress)
    jobs = []
    for seed in range(args.seeds):
        for method in METHODS:
            run_dir = runs / f"{method}-seed{seed}"
            if run_dir.exists():
                shutil.rmtree(run_dir)
            jobs.append(Job(f"{method}-seed{seed}",
                            train_command(args.config, run_dir,
                                          _overrides(args, L, seed, method)),
                            runs / f"{method}-seed{seed}.log"))
    run_jobs(jobs, args.jobs, label="tppo-vs-ppo")


def speedup_ceiling(ppo: dict) -> float | None:
    """The largest time-to-target speedup a T-PPO could have over this PPO run on this
    machine: PPO's step time over that of a T-PPO whose decode keeps every slot busy (the
    tokens PPO decoded, in ``occupancy`` of its decode steps) and whose update and grading
    cost per finished sample no more than PPO's, at PPO's samples to target. Only the
    rollout's idle slots can be won back, so a run whose update dominates its step caps the
    speedup near 1 whatever the window: ``(R + U + G) / (R * occupancy + U + G)``."""
    split, occ = ppo["time_split_s"], ppo.get("occupancy_mean")
    rest = split["update"] + split["grading"]
    if not occ or split["rollout"] + rest <= 0:
        return None
    return (split["rollout"] + rest) / (split["rollout"] * min(occ, 1.0) + rest)


def _speedup_bounds(tppo: dict, ppo: dict) -> list[float | None]:
    """``[low, high]`` bounds on PPO / T-PPO time to target when a run stopped first: a run
    that never reached the target would have taken longer than its last eval's clock.
    ``None`` = unbounded (neither reached). Equal to the speedup when both reached it."""
    t, p = tppo["time_to_target_s"], ppo["time_to_target_s"]
    last = lambda run: run["curve"][-1][0] if run["curve"] else None  # noqa: E731
    if t and p:
        return [p / t, p / t]
    if p and last(tppo):  # T-PPO slower than its whole run
        return [0.0, p / last(tppo)]
    if t and last(ppo):  # PPO slower than its whole run
        return [last(ppo) / t, None]
    return [0.0, None]


def _median_bounds(bounds: list[list[float | None]]) -> list[float | None]:
    """Bounds on the median speedup over seeds (the median is monotone in every seed's
    value, so the medians of the seeds' low and high bounds bound it)."""
    inf = float("inf")
    lo = statistics.median(b[0] for b in bounds)
    hi = statistics.median(inf if b[1] is None else b[1] for b in bounds)
    return [lo, None if hi == inf else hi]


def _medians(seeds: dict) -> dict:
    """Medians over seeds of the headline numbers (seeds where a value is None left out)."""
    def med(xs):
        return _median([x for x in xs if x is not None])

    per = list(seeds.values())
    speedups = [s["speedup"] for s in per if s["speedup"]]
    out = {
        "time_to_target_s": {m: med(s[m]["time_to_target_s"] for s in per) for m in METHODS},
        "speedup": med(speedups),
        "speedup_min": min(speedups) if speedups else None,
        "speedup_max": max(speedups) if speedups else None,
        # Where a run stopped before the target: the interval the median speedup lies in.
        "speedup_bounds": (_median_bounds([s["speedup_bounds"] for s in per])
                           if all("speedup_bounds" in s for s in per) else None),
        "throughput_ratio": med(s["throughput_ratio"] for s in per),
        "speedup_ceiling": med(s.get("speedup_ceiling") for s in per),
    }
    for key in ("finished_per_s", "useful_tokens_per_s", "occupancy_mean", "train_time_s",
                "final_eval_accuracy"):
        out[key] = {m: med(s[m][key] for s in per) for m in METHODS}
    out["final_eval"] = {m: {k: med(s[m].get("final_eval", {}).get(k) for s in per)
                             for k in per[0][m].get("final_eval", {})} for m in METHODS}
    out["time_split_s"] = {m: {k: med(s[m]["time_split_s"][k] for s in per) for k in PHASES}
                           for m in METHODS}
    return out


def _length_report(runs: Path, cfg) -> dict | None:
    """Solution lengths in tokens of the warm-start tokenizer (2000 training problems):
    median / p90 / p99 / max, against L."""
    import numpy as np

    from tppo_jax.data.run_data import synthetic_task
    from tppo_jax.models.tokenizer import Tokenizer
    from tppo_jax.weights.warmstart import warmstart_key

    tok_file = runs / f"warmstart-{warmstart_key(cfg)}" / "tokenizer.model"
    if cfg.data.source != "synthetic" or not tok_file.exists():
        return None
    tok = Tokenizer.load(tok_file)
    n = np.array([len(tok.encode(e.solution)) + 1 for e in synthetic_task(cfg).sample(2000)])
    return {"unit": "tokens (solution + EOS)", "n": int(n.size), "median": float(np.median(n)),
            "p90": float(np.percentile(n, 90)), "p99": float(np.percentile(n, 99)),
            "max": int(n.max()), "L": cfg.rollout.max_response_len,
            "frac_over_L_over_4": float((n > cfg.rollout.max_response_len / 4).mean())}


def _plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    colors = {"tppo": "tab:blue", "ppo": "tab:orange"}
    for seed, per in results["seeds"].items():
        for m in METHODS:
            curve = per[m]["curve"]
            if curve:
                xs, ys = zip(*curve, strict=True)
                ax.plot(xs, ys, color=colors[m], alpha=0.8,
                        label=f"{'T-PPO' if m == 'tppo' else 'PPO'}" if seed == "0" else None)
    ax.axhline(results["target"], color="gray", ls="--", lw=1, label="target")
    ax.set_xlabel("training wall-clock (s, held-out evals excluded)")
    ax.set_ylabel("held-out accuracy (avg@k sampled, %)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default="default")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--target", type=float, default=60.0,
                   help="held-out accuracy target (avg@k sampled, %%)")
    p.add_argument("--sweep", type=lambda v: [float(x) for x in v.split(",")], default=[],
                   help="comma-separated targets: also report the time to each and the "
                        "speedup (JSON 'target_sweep')")
    p.add_argument("--budget-s", type=float, default=600.0, help="per-run training budget")
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--eval-every-s", type=float, default=0.0,
                   help="also evaluate every this many seconds of training (one time grid for "
                        "both methods, whose steps differ in length)")
    p.add_argument("--max-steps", type=int, default=1000)
    p.add_argument("--jobs", type=int, default=1,
                   help="runs at a time, each on a core of its own (2: a seed's T-PPO and PPO "
                        "side by side)")
    p.add_argument("--out", default="results")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--seed", type=int, default=None,
                   help="train only this seed's runs (then --summarize-only)")
    p.add_argument("--method", choices=list(METHODS), default=None,
                   help="train only this method's runs (then --summarize-only)")
    p.add_argument("--summarize-only", action="store_true",
                   help="rebuild the JSON and PNG from the run dirs of an earlier run")
    p.add_argument("overrides", nargs="*", metavar="key=value")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    add_args(parser)
    run(parser.parse_args())
