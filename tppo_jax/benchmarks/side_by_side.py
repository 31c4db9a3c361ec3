"""Training runs as subprocesses, a few at a time, each pinned to a core of its own.

Benchmarks that compare runs (``tppo bench learning``, ``tppo bench tppo-vs-ppo``) run them
side by side this way: two runs on a 2-core machine each get one core for their whole life,
so their clocks are comparable, and no run shares its core with another.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Job:
    name: str
    args: list[str]  # ``tppo`` CLI arguments (``train --config ...``)
    log: Path  # stdout and stderr


METHODS = ("tppo", "ppo")


def method_overrides(method: str, L: int) -> list[str]:
    """The overrides that make a run ``method``: PPO is the same trainer with the window at
    the whole response (``L``). They go after the user's overrides, so a window given for the
    T-PPO runs leaves PPO at ``l = L``."""
    if method not in METHODS:
        raise SystemExit(f"--methods: unknown method {method!r} (tppo, ppo)")
    return [f"rollout.window={L}"] if method == "ppo" else []


def train_command(config: str, run_dir: Path, overrides: list[str]) -> list[str]:
    """``tppo train`` of ``config`` into ``run_dir``, as CLI arguments."""
    return ["train", "--config", config, "--run-dir", str(run_dir), "--no-progress",
            *overrides]


def warmstart_once(config: str, overrides: list[str], runs: Path, *, progress: bool) -> None:
    """Trains the tiny model's warm-start into ``runs`` (the cache its runs share) before any
    job starts, so parallel runs do not each train it; other model sources need none."""
    from tppo_jax.config import load_config
    from tppo_jax.weights.warmstart import cached

    cfg = load_config(config, overrides)
    runs.mkdir(parents=True, exist_ok=True)
    if cfg.model.source == "tiny":
        cached(cfg, runs, progress=progress)


def run_jobs(jobs: list[Job], n: int, *, label: str) -> None:
    """Runs every job, ``n`` at a time (each on its own core when ``n > 1`` and ``taskset``
    exists), started in order, the next as soon as any running one ends; a failed job stops
    the rest with a one-line error naming its log."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    pending, live = list(jobs), []
    while pending or live:
        while pending and len(live) < n:
            job = pending.pop(0)
            cmd = [sys.executable, "-m", "tppo_jax.cli", *job.args]
            used = {core for _, _, core in live}
            core = next((c for c in cores if c not in used), None)
            if n > 1 and core is not None and shutil.which("taskset"):
                cmd = ["taskset", "-c", str(core), *cmd]
            job.log.parent.mkdir(parents=True, exist_ok=True)
            print(f"[{label}] {job.name}: {' '.join(cmd)}", flush=True)
            with job.log.open("w") as log:
                proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
            live.append((proc, job, core))
        # The first to finish frees its core (jobs of unequal length, such as a sampled and
        # a greedy eval, do not leave a core idle behind the longer one).
        while not any(p.poll() is not None for p, _, _ in live):
            time.sleep(0.2)
        proc, job, _ = next(x for x in live if x[0].poll() is not None)
        live = [x for x in live if x[0] is not proc]
        if proc.returncode:
            for other, _, _ in live:
                other.terminate()
            raise SystemExit(f"[{label}] {job.name} failed (exit {proc.returncode}); see "
                             f"{job.log}")
