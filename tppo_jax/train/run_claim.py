"""Claiming a run directory before a run starts: one writer (the lock) and a start that
loses nothing (no appending to, or restarting over, another run's checkpoints and logs)."""

from __future__ import annotations

from collections.abc import Callable

from tppo_jax.parallel import multihost as mh
from tppo_jax.train.checkpoint import listed_steps
from tppo_jax.train.run_dir import (
    RunDir,
    RunDirError,
    found_logs,
    lock_run_dir,
    resolve_run_dir,
)


def claim_run_dir(rd: RunDir, resume: bool, *, check: bool = True) -> Callable[[], None]:
    """Process 0 takes the run dir's lock (one writer) and (``check``) checks that this
    start loses nothing (``start_problem``); every process gets its answer, so all stop or
    none. Returns the function that lets go of the lock; ``RunDirError`` (one line) else."""
    release: Callable[[], None] = lambda: None  # noqa: E731
    problem = None
    if mh.is_primary():
        try:
            release = lock_run_dir(rd.local)
            if check:
                start_problem(rd, resume)
        except RunDirError as e:
            problem = str(e)
    problems = [p for p in mh.gather_json(problem) if p]
    if problems:
        release()
        raise RunDirError(problems[0])
    return release


_START_OVER = ("--start-over starts it again at step 0 (its logs move to replaced-<time>/ "
               "in the run dir; nothing is deleted)")


def start_problem(rd: RunDir, resume: bool) -> None:
    """``RunDirError`` when starting would append to, or restart over, another run: a new
    run where checkpoints or logs are, or a resume that finds no checkpoint to continue
    from although the run has logs (or damaged checkpoints, or checkpoints elsewhere).
    A resume with nothing there at all is a fresh start (a launcher always passes --resume)."""
    steps, damaged = listed_steps(rd.checkpoints)
    if steps and not resume:
        raise RunDirError(f"{rd.checkpoints} already has checkpoints (latest step {steps[0]}): "
                          f"pass --resume to continue the run, or choose a new --run-dir")
    logs = found_logs(rd)
    if not resume:
        if logs:
            raise RunDirError(f"{rd.local} holds another run's logs ({', '.join(logs)}): "
                              f"--resume continues that run, {_START_OVER}, or choose a "
                              f"new --run-dir")
        return
    if steps:
        return
    own = resolve_run_dir(rd.remote or rd.local).checkpoints  # where checkpoint.dir="" puts them
    elsewhere = listed_steps(own)[0] if own != rd.checkpoints else []
    found = ([f"set aside as damaged: {', '.join(damaged)}"] if damaged else []) + (
        [f"{own} has step {elsewhere[0]}: is checkpoint.dir right?"] if elsewhere else []) + (
        [f"logs: {', '.join(logs)}"] if logs else [])
    if found:
        raise RunDirError(f"--resume found no usable checkpoint in {rd.checkpoints} "
                          f"({'; '.join(found)}) and would start again at step 0 over the "
                          f"run's logs: {_START_OVER}")
