"""T-PPO (window l) vs synchronous PPO (l = L), side by side on the same task, model and seeds.

Each (method, seed) run trains until held-out greedy accuracy reaches ``--target`` (percent)
or ``--budget-s`` seconds of training wall-clock pass (held-out evals excluded from the
clock). Both methods start from the same warm-started policy. Writes
``results/tppo_vs_ppo.json`` (per seed and median: ``time_to_target_s`` per method and
``speedup``) and ``results/tppo_vs_ppo.png`` (held-out accuracy vs training wall-clock).

    tppo bench tppo-vs-ppo --seeds 3 --target 60 --budget-s 600
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

METHODS = {"tppo": [], "ppo": ["rollout.window={L}"]}


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def summarize_run(run_dir: Path, target: float) -> dict:
    """Time/steps to target from a run's metrics.jsonl (None when never reached)."""
    rows = _rows(run_dir)
    steps = [r for r in rows if "reward_mean" in r]
    evals = [r for r in rows if "eval_accuracy" in r]
    hit = next((r for r in evals if r["eval_accuracy"] >= target), None)
    train_time = {r["step"]: r["train_time_s"] for r in steps}
    return {
        "time_to_target_s": train_time.get(hit["step"]) if hit else None,
        "steps_to_target": hit["step"] if hit else None,
        "final_eval_accuracy": evals[-1]["eval_accuracy"] if evals else None,
        "tokens_generated": int(sum(r["tokens"] for r in steps)),
        "occupancy_mean": statistics.fmean(r["occupancy"] for r in steps) if steps else None,
        "time_split_s": {k: float(sum(r[f"time_{k}_s"] for r in steps))
                         for k in ("rollout", "grading", "update")},
        "curve": _before(run_dir) + [(train_time.get(r["step"], 0.0), r["eval_accuracy"])
                                     for r in evals],
    }


def _before(run_dir: Path) -> list[tuple[float, float]]:
    path = run_dir / "eval_before.json"
    return [(0.0, json.loads(path.read_text())["accuracy"])] if path.exists() else []


def run(args: argparse.Namespace) -> dict:
    from tppo_jax.config import load_config
    from tppo_jax.train.trainer import train

    out_dir = Path(args.out)
    base = load_config(args.config)
    L = base.rollout.max_response_len
    results: dict = {"target": args.target, "budget_s": args.budget_s, "config": args.config,
                     "seeds": {}}
    for seed in range(args.seeds):
        per = {}
        for method, extra in METHODS.items():
            overrides = [f"train.seed={seed}", f"train.eval_every={args.eval_every}",
                         f"train.target_accuracy={args.target}",
                         f"train.time_budget_s={args.budget_s}", f"train.steps={args.max_steps}",
                         *[e.format(L=L) for e in extra], *args.overrides]
            cfg = load_config(args.config, overrides)
            run_dir = out_dir / "runs" / f"{method}-seed{seed}"
            if not args.summarize_only:  # else: re-read the run dirs of an earlier run
                if run_dir.exists():
                    import shutil

                    shutil.rmtree(run_dir)
                train(cfg, run_dir, progress=not args.no_progress)
            per[method] = summarize_run(run_dir, args.target)
        t, p = per["tppo"]["time_to_target_s"], per["ppo"]["time_to_target_s"]
        per["speedup"] = (p / t) if (t and p) else None
        results["seeds"][str(seed)] = per
        print(f"seed {seed}: T-PPO {t} s, PPO {p} s, speedup {per['speedup']}")
    speedups = [s["speedup"] for s in results["seeds"].values() if s["speedup"]]
    med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    results["median"] = {
        "time_to_target_s": {m: med([s[m]["time_to_target_s"] for s in results["seeds"].values()
                                     if s[m]["time_to_target_s"]]) for m in METHODS},
        "speedup": med(speedups),
        "speedup_min": min(speedups) if speedups else None,
        "speedup_max": max(speedups) if speedups else None,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "tppo_vs_ppo.json").write_text(json.dumps(results, indent=2))
    _plot(results, out_dir / "tppo_vs_ppo.png")
    print(json.dumps(results["median"], indent=2))
    return results


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
    p.add_argument("--budget-s", type=float, default=600.0, help="per-run training budget")
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--max-steps", type=int, default=1000)
    p.add_argument("--out", default="results")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--summarize-only", action="store_true",
                   help="rebuild the JSON and PNG from the run dirs of an earlier run")
    p.add_argument("overrides", nargs="*", metavar="key=value")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    add_args(parser)
    run(parser.parse_args())
