"""Does RL make the policy better? One config over seeds, with a no-signal control.

Each (method, arm, seed) is a ``tppo train`` run from the same warm-started policy; its
``summary.json`` holds the held-out eval before and after. For every run this reports the
four numbers a learning claim needs, before -> after with binomial standard errors:
sampled avg@k, pass@k, greedy accuracy and the fraction of sampled solutions whose every
step is valid; and the greedy answers that changed (right -> wrong, wrong -> right: a
sharper, deterministic count than the greedy accuracy). From ``metrics.jsonl``: the critic's
explained variance, approx. KL and entropy per step, and where the advantage goes (mean per
token on right, wrong and unfinished rows; right-answer tokens with a negative advantage).

Arms: ``rl`` (the config as given) and, with ``--control-seeds N``, ``control``: the same
run with ``reward.shuffle_control=true`` (each step's grades permuted across its finished
rows: no signal). The control must not gain; what it loses measures the update's noise.
Methods: ``tppo`` (the config) and ``ppo`` (``rollout.window=L``), ``--methods tppo,ppo``.

    tppo bench learning --config default --seeds 3 --control-seeds 1 --jobs 2
    tppo bench learning --config longtail --methods tppo,ppo --seeds 3 --jobs 2
    tppo bench learning --config default --tag lr2 optim.policy_lr=2e-5   # a probe
    tppo bench learning --config longtail --methods tppo,ppo --seeds 3 --summarize-only \
        --heldout 256      # the finished runs, scored again on 256 held-out questions

``--jobs 2`` runs two at a time, each pinned to its own core (``taskset``), after the
warm-start is trained once. Writes ``results/learning_<config>[_<tag>][_<methods>].json``
(methods other than ``tppo`` alone) and its PNG;
``--summarize-only`` rebuilds both from the run dirs.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
from pathlib import Path

from tppo_jax.benchmarks.heldout_rescore import rescore_jobs, rescored_evals, start_dirs
from tppo_jax.benchmarks.side_by_side import (
    Job,
    method_overrides,
    run_jobs,
    train_command,
    warmstart_once,
)

METRICS = (("avg", "sampled avg@k"), ("pass", "pass@k"), ("greedy", "greedy"),
           ("steps_valid", "steps valid"))
CURVES = ("reward_mean", "explained_variance", "approx_kl", "entropy", "adv_right_mean",
          "adv_wrong_mean", "adv_unfinished_mean", "adv_right_neg_frac", "group_baseline_frac")


def binomial_se(p_percent: float, n: int) -> float:
    """Standard error (percent) of a proportion measured on ``n`` independent trials."""
    p = p_percent / 100.0
    return 100.0 * math.sqrt(max(p * (1.0 - p), 0.0) / max(n, 1))


def greedy_changes(before: str, after: str) -> dict[str, int]:
    """Questions whose greedy answer went right -> wrong (``lost``) and wrong -> right
    (``gained``), from two ``correct_mask`` strings ("x" right, "." wrong)."""
    if len(before) != len(after):
        raise ValueError(f"masks of different lengths: {len(before)} vs {len(after)}")
    lost = sum(b == "x" and a == "." for b, a in zip(before, after, strict=True))
    gained = sum(b == "." and a == "x" for b, a in zip(before, after, strict=True))
    return {"lost": lost, "gained": gained}


def paired_se(changed: list[dict[str, list[int]]], n_questions: int) -> float:
    """Standard error (points) of the greedy accuracy's change, averaged over runs scored on
    the same ``n_questions``, from each run's ``changed_questions``. The change is a mean
    over questions of each question's change (-1, 0 or +1 per run, averaged over runs), so
    its error comes from the questions that moved, not from the ~90% that score the same
    before and after (an unpaired binomial error counts those too); and a question every
    seed loses counts as one question, not as independent evidence per seed."""
    d = [0.0] * n_questions
    for ch in changed:
        for i in ch["lost"]:
            d[i] -= 1.0 / len(changed)
        for i in ch["gained"]:
            d[i] += 1.0 / len(changed)
    return 100.0 * statistics.stdev(d) / math.sqrt(n_questions) if n_questions > 1 else 0.0


def changed_questions(before: str, after: str) -> dict[str, list[int]]:
    """The held-out indices behind ``greedy_changes``: whether seeds lose the *same* questions
    (a systematic effect of the reward) or different ones (the update's noise)."""
    pairs = list(zip(before, after, strict=True))
    return {"lost": [i for i, (b, a) in enumerate(pairs) if b == "x" and a == "."],
            "gained": [i for i, (b, a) in enumerate(pairs) if b == "." and a == "x"]}


def four_numbers(ev: dict, k: int) -> dict[str, float]:
    """avg@k, pass@k, greedy (percent) and steps-valid fraction of one held-out eval."""
    return {"avg": ev[f"avg@{k}"], "pass": ev[f"pass@{k}"], "greedy": ev["greedy_accuracy"],
            "steps_valid": ev["steps_all_valid_frac"]}


def summarize_run(run_dir: Path, k: int, n_questions: int | None = None,
                  evals: tuple[dict, dict] | None = None) -> dict:
    """One run's before/after, changes with standard errors, greedy changes and curves.
    ``evals``: ``(before, after)`` to use instead of the run's in-run evals (``--heldout``);
    ``n_questions``: by default, the length of the greedy answers' mask before."""
    summary = json.loads((run_dir / "summary.json").read_text())
    before, after = evals or (summary["eval_before"], summary["eval_after"])
    n_questions = n_questions or len(before["greedy_correct_mask"])
    b, a = four_numbers(before, k), four_numbers(after, k)
    trials = {"avg": n_questions * k, "pass": n_questions, "greedy": n_questions,
              "steps_valid": n_questions * k}
    out: dict = {"before": b, "after": a, "delta": {m: a[m] - b[m] for m in b}, "se": {},
                 "questions": n_questions}
    for m in ("avg", "pass", "greedy"):
        out["se"][m] = math.hypot(binomial_se(b[m], trials[m]), binomial_se(a[m], trials[m]))
    if "greedy_correct_mask" in before and "greedy_correct_mask" in after:
        out["greedy_changes"] = greedy_changes(before["greedy_correct_mask"],
                                               after["greedy_correct_mask"])
        out["greedy_changed_questions"] = changed_questions(before["greedy_correct_mask"],
                                                            after["greedy_correct_mask"])
        out["se"]["greedy_paired"] = paired_se([out["greedy_changed_questions"]], n_questions)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward_mean" in r]
    out["steps"] = len(steps)
    out["train_time_s"] = steps[-1]["train_time_s"] if steps else 0.0
    out["curves"] = {c: [r.get(c) for r in steps] for c in CURVES}
    out["boxed_frac"] = [before.get("boxed_frac"), after.get("boxed_frac")]
    return out


def aggregate(runs: list[dict]) -> dict:
    """Mean, min and max over seeds of every delta; greedy changes summed."""
    out: dict = {}
    for m, _ in METRICS:
        xs = [r["delta"][m] for r in runs]
        out[m] = {"mean": statistics.fmean(xs), "min": min(xs), "max": max(xs)}
    ch = [r["greedy_changes"] for r in runs if "greedy_changes" in r]
    if ch:
        out["greedy_changes"] = {k: sum(c[k] for c in ch) for k in ("lost", "gained")}
    if (all("greedy_changed_questions" in r for r in runs)
            and len({r["questions"] for r in runs}) == 1):
        out["greedy"]["paired_se"] = paired_se([r["greedy_changed_questions"] for r in runs],
                                               runs[0]["questions"])
    lost = [q for r in runs for q in r.get("greedy_changed_questions", {}).get("lost", [])]
    if lost:  # question -> how many runs lost it (the same few in every seed: systematic)
        out["greedy_lost_by_question"] = {str(q): lost.count(q) for q in sorted(set(lost))}
    return out


def meets(agg: dict, *, avg_gain: float, greedy_drop: float) -> dict[str, bool]:
    """The learning targets on the means over seeds: avg@k up by ``avg_gain``, pass@k not
    down, greedy down by at most ``greedy_drop`` points."""
    return {"avg": agg["avg"]["mean"] >= avg_gain, "pass": agg["pass"]["mean"] >= 0.0,
            "greedy": agg["greedy"]["mean"] >= -greedy_drop}


def _jobs(args: argparse.Namespace, L: int) -> list[tuple[str, list[str]]]:
    """``(run name, overrides)`` of every run, in the order they train: the run's seed and
    arm, the user's overrides, then what makes it its method."""
    out = []
    for method in args.methods.split(","):
        arms = [(f"rl-seed{s}", [f"train.seed={s}"]) for s in range(args.seeds)]
        arms += [(f"control-seed{s}", [f"train.seed={s}", "reward.shuffle_control=true"])
                 for s in range(args.control_seeds)]
        out += [(f"{method}-{arm}", [*extra, *args.overrides, *method_overrides(method, L)])
                for arm, extra in arms]
    return out


def _prefix(args: argparse.Namespace) -> str:
    return Path(args.config).stem + (f"-{args.tag}" if args.tag else "")


def finished(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds a run that ended with its held-out eval after training."""
    try:
        return json.loads((run_dir / "summary.json").read_text()).get("eval_after") is not None
    except (OSError, ValueError):
        return False


def _train_all(args: argparse.Namespace, jobs: list[tuple[str, list[str]]], runs: Path) -> None:
    """Trains every job (``--jobs`` at a time, one core each); the warm-start first, once."""
    warmstart_once(args.config, args.overrides, runs, progress=not args.no_progress)
    todo = []
    for name, overrides in jobs:
        run_dir = runs / f"{_prefix(args)}-{name}"
        if args.reuse and finished(run_dir):
            print(f"[learning] {name}: reusing the finished run in {run_dir}", flush=True)
            continue
        if run_dir.exists():
            shutil.rmtree(run_dir)
        todo.append(Job(name, train_command(args.config, run_dir, overrides),
                        runs / f"{_prefix(args)}-{name}.log"))
    run_jobs(todo, args.jobs, label="learning")


def run(args: argparse.Namespace) -> dict:
    from tppo_jax.config import load_config

    cfg = load_config(args.config, args.overrides)
    L, k = cfg.rollout.max_response_len, cfg.train.eval_samples
    runs = Path(args.runs)
    jobs = _jobs(args, L)
    if not args.summarize_only:
        _train_all(args, jobs, runs)
    dirs = {name: runs / f"{_prefix(args)}-{name}" for name, _ in jobs}
    if args.heldout:
        missing = [str(d) for d in dirs.values() if not finished(d)]
        if missing:
            raise SystemExit(f"--heldout: no finished run in {', '.join(missing)}")
        run_jobs(rescore_jobs(dirs, args.heldout), args.jobs, label="learning --heldout")
    starts = start_dirs(dirs)
    per = {name: summarize_run(run_dir, k, evals=rescored_evals(run_dir, starts[name],
                                                                args.heldout)
                               if args.heldout else None)
           for name, run_dir in dirs.items()}
    n_q = next(iter(per.values()))["questions"]
    groups: dict = {}
    for name, r in per.items():
        method, arm, _ = name.split("-")
        groups.setdefault(f"{method}-{arm}", []).append(r)
    results = {"config": args.config, "tag": args.tag, "overrides": args.overrides, "k": k,
               "held_out_questions": n_q, "held_out_rescored": bool(args.heldout),
               "runs": per,
               "aggregate": {g: aggregate(rs) for g, rs in groups.items()}}
    results["target_thresholds"] = {"avg_gain": args.avg_gain, "greedy_drop": args.greedy_drop}
    results["targets"] = {g: meets(a, avg_gain=args.avg_gain, greedy_drop=args.greedy_drop)
                          for g, a in results["aggregate"].items() if g.endswith("-rl")}
    methods = "" if args.methods == "tppo" else "_" + args.methods.replace(",", "_")
    heldout = f"_heldout{args.heldout}" if args.heldout else ""
    out = Path(args.out) / f"learning_{_prefix(args).replace('-', '_')}{methods}{heldout}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    _plot(results, out.with_suffix(".png"))
    _print_table(results)
    print(f"wrote {out}")
    return results


def _print_table(results: dict) -> None:
    k = results["k"]
    print(f"| run | avg@{k} | pass@{k} | greedy | steps valid | greedy right->wrong / "
          f"wrong->right |")
    print("|---|---|---|---|---|---|")
    for name, r in results["runs"].items():
        b, a, se = r["before"], r["after"], r["se"]
        cells = [f"{b[m]:.1f} -> {a[m]:.1f} ({a[m] - b[m]:+.1f} ± {se[m]:.1f})"
                 for m in ("avg", "pass", "greedy")]
        ch = r.get("greedy_changes", {})
        print(f"| {name} | {' | '.join(cells)} | {b['steps_valid']:.2f} -> "
              f"{a['steps_valid']:.2f} | {ch.get('lost', '-')} / {ch.get('gained', '-')} |")
    for group, agg in results["aggregate"].items():
        g = agg["greedy"]
        if "paired_se" in g:  # the mean's error from the questions that moved
            print(f"{group}: greedy {g['mean']:+.1f} ± {g['paired_se']:.1f} (mean over seeds, "
                  f"paired standard error over questions)")


def _plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["runs"])
    fig, axes = plt.subplots(1, len(METRICS) + 1, figsize=(4 * (len(METRICS) + 1), 4))
    for ax, (m, label) in zip(axes, METRICS, strict=False):
        for i, name in enumerate(names):
            r = results["runs"][name]
            color = "tab:red" if "-control-" in name else "tab:blue"
            ax.plot([i, i], [r["before"][m], r["after"][m]], color=color, lw=2)
            ax.plot(i, r["after"][m], "o", color=color)
            ax.plot(i, r["before"][m], "_", color="k", ms=12)
        ax.set_xticks(range(len(names)), names, rotation=60, ha="right", fontsize=7)
        ax.set_title(f"{label}: before (-) -> after (o)")
        ax.grid(alpha=0.3)
    ax = axes[-1]
    for name in names:
        ev = [x for x in results["runs"][name]["curves"]["explained_variance"] if x is not None]
        ax.plot(ev, label=name, color="tab:red" if "-control-" in name else None, lw=1)
    ax.set_title("critic explained variance per step")
    ax.legend(fontsize=6)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default="default")
    p.add_argument("--seeds", type=int, default=3, help="train.seed 0..N-1 of the config")
    p.add_argument("--control-seeds", type=int, default=0,
                   help="shuffled-reward control runs (seeds 0..N-1)")
    p.add_argument("--methods", default="tppo", help="tppo, ppo or tppo,ppo")
    p.add_argument("--jobs", type=int, default=1, help="runs at a time (one core each)")
    p.add_argument("--tag", default="", help="names a variant: its run dirs and JSON")
    p.add_argument("--runs", default="runs/learning", help="run dirs (and the warm-start "
                   "cache they share)")
    p.add_argument("--out", default="results")
    p.add_argument("--avg-gain", type=float, default=15.0, help="target: avg@k gain (points)")
    p.add_argument("--greedy-drop", type=float, default=1.0,
                   help="target: most greedy accuracy lost (points)")
    p.add_argument("--reuse", action="store_true",
                   help="keep runs that already finished (more seeds: train only the new ones)")
    p.add_argument("--summarize-only", action="store_true")
    p.add_argument("--heldout", type=int, default=0, metavar="N",
                   help="score the finished runs' starting and final policies again on the "
                   "synthetic task's first N held-out questions (tppo eval --eval-size N; "
                   "kept in the run dirs) and report those: writes ..._heldoutN.json")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("overrides", nargs="*", help="config overrides KEY=VALUE for every run")
