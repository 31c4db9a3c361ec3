"""A learning bench's finished runs, scored again on a bigger held-out set.

On 64 held-out questions one question is 1.6 points, and a greedy answer whose right token
leads its rival by a few hundredths of a nat is a coin that any update may flip: "greedy not
down" is then a statement about two or three coins. The synthetic task's held-out split is
prefix-stable, so ``tppo eval --eval-size N`` scores a run's starting and final policies on
N questions that hold its own and none it trained on, under the run's own protocol (its
sampling, ``train.eval_samples``, its seed), without training anything again.

Each seed's starting policy is scored once (every run of a seed starts from the same
warm-start with the same eval seed) in the first run of that seed; each run's final policy
in the run. The JSONs are kept in the run dirs, so a second call only summarizes.
"""

from __future__ import annotations

import json
from pathlib import Path

from tppo_jax.benchmarks.side_by_side import Job


def eval_path(run_dir: Path, which: str, n: int, *, greedy: bool) -> Path:
    """Where ``tppo eval`` keeps the ``which`` (``start`` or ``final``) policy's score."""
    return run_dir / f"eval_{which}_n{n}{'_greedy' if greedy else ''}.json"


def eval_command(run_dir: Path, which: str, n: int, *, greedy: bool) -> list[str]:
    """``tppo eval`` of a run's ``which`` policy on ``n`` held-out questions."""
    return ["eval", str(run_dir), "--eval-size", str(n),
            "--out", str(eval_path(run_dir, which, n, greedy=greedy)),
            *(["--start"] if which == "start" else []), *(["--greedy"] if greedy else [])]


def start_dirs(runs: dict[str, Path]) -> dict[str, Path]:
    """Run name -> the run dir that holds its seed's starting-policy score: the first run
    (in ``runs``' order) of the same seed. Names end in ``-seed<s>``."""
    first: dict[str, Path] = {}
    out = {}
    for name, run_dir in runs.items():
        seed = name.rsplit("-", 1)[-1]
        out[name] = first.setdefault(seed, run_dir)
    return out


def rescore_jobs(runs: dict[str, Path], n: int) -> list[Job]:
    """The ``tppo eval`` jobs still missing: each seed's start and each run's final policy,
    sampled and greedy."""
    wanted = [(d, "start") for d in dict.fromkeys(start_dirs(runs).values())]
    wanted += [(d, "final") for d in runs.values()]
    jobs = []
    for run_dir, which in wanted:
        for greedy in (False, True):
            path = eval_path(run_dir, which, n, greedy=greedy)
            if not path.exists():
                name = f"{run_dir.name} {which}{' greedy' if greedy else ''}"
                jobs.append(Job(name, eval_command(run_dir, which, n, greedy=greedy),
                                path.with_suffix(".log")))
    return jobs


# What ``tppo eval`` adds to ``evaluate``'s metrics: not part of an in-run eval record.
CLI_KEYS = ("step", "start", "k", "greedy", "questions", "protocol")


def as_run_eval(sampled: dict, greedy: dict) -> dict:
    """Two ``tppo eval`` results (sampled, greedy) as the run's own held-out eval records
    them (``summary.json``'s ``eval_before`` / ``eval_after``)."""
    from tppo_jax.eval.heldout import eval_record

    def metrics(res: dict) -> dict:
        return {m: v for m, v in res.items() if m not in CLI_KEYS}
    return eval_record(metrics(sampled), metrics(greedy), sampled["k"])


def rescored_evals(run_dir: Path, start_dir: Path, n: int) -> tuple[dict, dict]:
    """``(before, after)`` of one run on ``n`` held-out questions, as ``summary.json``'s."""
    def read(d: Path, which: str) -> dict:
        return as_run_eval(*(json.loads(eval_path(d, which, n, greedy=g).read_text())
                             for g in (False, True)))
    return read(start_dir, "start"), read(run_dir, "final")
