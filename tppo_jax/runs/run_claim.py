"""Claiming a run directory before a run starts: one writer (the lock) and a start that
loses nothing (no appending to, or restarting over, another run's checkpoints and logs).

The checkpoint folder is claimed too: it may be anywhere (``checkpoint.dir``, a bucket
shared by launches), and a resume restores, writes into and prunes whatever folder it is
given. Each run has an id (``RUN/run_id``, made at its first start) and its checkpoint
folder records the id of the run that owns it (``CHECKPOINTS/OWNER``); a run refuses a
folder that another run owns, and a local folder outside the run dir is locked like it."""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable
from pathlib import Path

from etils import epath

from tppo_jax.parallel import multihost as mh
from tppo_jax.runs.checkpoint import checkpoint_path, listed_steps
from tppo_jax.runs.run_dir import (
    RunDir,
    RunDirError,
    found_logs,
    is_url,
    lock_run_dir,
    resolve_run_dir,
)

log = logging.getLogger(__name__)

RUN_ID = "run_id"  # RUN/run_id: the run's id, made at its first start, and the run dir
OWNER = "OWNER"  # CHECKPOINTS/OWNER: {"run_id", "run_dir"} of the run whose folder it is


def claim_run_dir(rd: RunDir, resume: bool, *, check: bool = True,
                  train_steps: int | None = None, lend: bool = False) -> Callable[[], None]:
    """Process 0 takes the run dir's lock (one writer) and (``check``) checks that this
    start loses nothing (``start_problem``, ``finished_problem`` with ``train_steps``) and
    claims the checkpoint folder; every process gets its answer, so all stop or none.
    ``lend``: the one Trainer this caller builds may take the lock again (``lock_run_dir``).
    Returns the function that lets go of the lock(s); ``RunDirError`` (one line) else."""
    releases: list[Callable[[], None]] = []
    problem = None
    if mh.is_primary():
        try:
            check_writable(rd.local)
            releases.append(lock_run_dir(rd.local, lend=lend))
            if check:
                start_problem(rd, resume)
                if resume and train_steps is not None:
                    finished_problem(rd, train_steps)
                if _outside_run_dir(rd):  # one writer per checkpoint folder too
                    releases.append(lock_run_dir(Path(str(checkpoint_path(rd.checkpoints)))))
                claim_checkpoints(rd)
        except RunDirError as e:
            problem = str(e)

    def release() -> None:
        for r in reversed(releases):
            r()

    problems = [p for p in mh.gather_json(problem) if p]
    if problems:
        release()
        raise RunDirError(problems[0])
    return release


MIN_FREE_BYTES = 64 << 20  # below this a run cannot write one checkpoint of the tiny model


def check_writable(folder: Path) -> None:
    """``RunDirError`` (one line) when ``folder`` cannot be created or written, or its disk
    has under ``MIN_FREE_BYTES`` free: said before any work, not as a traceback later."""
    import os
    import shutil

    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RunDirError(f"cannot create the run dir {folder}: {e.strerror or e}; choose "
                          f"another --run-dir or fix access") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise RunDirError(f"cannot write the run dir {folder} (permission denied); choose "
                          f"another --run-dir or fix access")
    free = shutil.disk_usage(folder).free
    if free < MIN_FREE_BYTES:
        raise RunDirError(f"disk full under {folder}: {free >> 20} MiB free, a run needs at "
                          f"least {MIN_FREE_BYTES >> 20} MiB; free space, or choose another "
                          f"--run-dir")


def finished_problem(rd: RunDir, train_steps: int) -> None:
    """``RunDirError`` when a resume has nothing to do: the run's latest checkpoint is at
    (or past) ``train.steps``. Refused before anything is rewritten (config.yaml, evals,
    summary.json)."""
    steps, _ = listed_steps(rd.checkpoints)
    if not steps or steps[0] < train_steps:
        return
    run = rd.remote or rd.local
    if steps[0] == train_steps:
        raise RunDirError(f"{run} is finished at step {steps[0]} (train.steps={train_steps}); "
                          f"raise train.steps to continue")
    raise RunDirError(f"{run} is at step {steps[0]}, past train.steps={train_steps}; raise "
                      f"train.steps above {steps[0]} to continue")


def _outside_run_dir(rd: RunDir) -> bool:
    """Whether the checkpoint folder is a local folder outside the (locked) run dir."""
    if is_url(rd.checkpoints):
        return False
    ckpt = Path(str(checkpoint_path(rd.checkpoints)))
    return not ckpt.is_relative_to(rd.local)


def _read_text(path: epath.Path) -> str | None:
    try:
        return path.read_text() if path.exists() else None
    except (OSError, UnicodeDecodeError) as e:
        raise RunDirError(f"{path} cannot be read ({e}): fix access, or choose another "
                          f"--run-dir") from None


def _id_record(rd: RunDir) -> tuple[str, str | None] | None:
    """``(id, the run dir it was made in or None)`` from ``RUN/run_id`` (locally or in a
    bucket run's bucket: its first line is the id, its second where the run started)."""
    for root in [epath.Path(rd.local)] + ([epath.Path(rd.remote)] if rd.remote else []):
        text = _read_text(root / RUN_ID)
        lines = [x.strip() for x in (text or "").splitlines() if x.strip()]
        if lines:
            return lines[0], (lines[1] if len(lines) > 1 else None)
    return None


def run_id(rd: RunDir) -> str | None:
    """The run's id (``RUN/run_id``, locally or in a bucket run's bucket); None before
    the run's first start."""
    record = _id_record(rd)
    return record[0] if record else None


def _write_id(rd: RunDir, ident: str) -> None:
    for root in [epath.Path(rd.local)] + ([epath.Path(rd.remote)] if rd.remote else []):
        root.mkdir(parents=True, exist_ok=True)
        (root / RUN_ID).write_text(f"{ident}\n{rd.remote or rd.local}\n")


def _own_id(rd: RunDir) -> str | None:
    """The run's id, made its own when the run dir is a copy: a run dir whose id was made
    in another run dir that still holds that id gets a new one (two live copies would
    share one id, and with it each other's checkpoint folder); a moved one keeps its id."""
    record = _id_record(rd)
    if record is None:
        return None
    ident, made = record
    here = str(rd.remote or rd.local)
    if made == here:
        return ident
    if made is not None:
        origin = resolve_run_dir(made)
        other = _id_record(origin) if origin.local != rd.local else None
        if other is not None and other[0] == ident:
            new = uuid.uuid4().hex
            log.warning("%s is a copy of %s (run id %s): it is a run of its own from now on, "
                        "run id %s", here, made, ident, new)
            _write_id(rd, new)
            return new
    _write_id(rd, ident)  # moved, or written before ids named their run dir
    return ident


def checkpoint_owner(checkpoints: str) -> dict[str, str] | None:
    """``{"run_id", "run_dir"}`` of the run that owns the checkpoint folder; None when it
    names none (a new folder, or one written before folders had owners)."""
    path = checkpoint_path(checkpoints) / OWNER
    text = _read_text(path)
    if text is None:
        return None
    try:
        owner = json.loads(text)
        if isinstance(owner, dict) and isinstance(owner.get("run_id"), str):
            return {"run_id": owner["run_id"], "run_dir": str(owner.get("run_dir", "?"))}
    except ValueError:
        pass
    raise RunDirError(f"{path} is not an owner record (damaged?): it names the run that owns "
                      f"the checkpoints; restore it, or choose another checkpoint.dir")


def _has_config(rd: RunDir) -> bool:
    roots = [epath.Path(rd.local)] + ([epath.Path(rd.remote)] if rd.remote else [])
    return any((root / "config.yaml").exists() for root in roots)


def claim_checkpoints(rd: RunDir) -> str:
    """Makes the run's checkpoint folder its own and returns the run's id. ``RunDirError``
    (one line) when another run owns the folder and it holds checkpoints, or when it holds
    checkpoints that name no owner and this run is new (no config.yaml) while the folder
    is not the run dir's own: resuming would splice two runs (restore the other's step,
    write into and prune its folder). An owned folder with no checkpoint left is taken."""
    owner = checkpoint_owner(rd.checkpoints)
    mine = _own_id(rd)
    steps, damaged = listed_steps(rd.checkpoints)
    held = (f"latest step {steps[0]}" if steps else f"set aside: {', '.join(damaged)}"
            ) if steps or damaged else ""
    own_folder = not is_url(rd.checkpoints) and not _outside_run_dir(rd)  # copied with it
    if owner is not None and owner["run_id"] != mine and held and not own_folder:
        raise RunDirError(
            f"{rd.checkpoints} belongs to another run ({owner['run_dir']}, id "
            f"{owner['run_id']}; {held}): a run restores, writes and prunes only its own "
            f"checkpoints; choose another checkpoint.dir (or --run-dir {owner['run_dir']} "
            f"to continue that run)")
    if owner is None and steps and mine is None and not _has_config(rd) and (
            is_url(rd.checkpoints) or _outside_run_dir(rd)):
        raise RunDirError(
            f"{rd.checkpoints} holds checkpoints ({held}) that name no owning run, and "
            f"{rd.remote or rd.local} is a new run: resuming would continue another run "
            f"there; choose another checkpoint.dir (or the --run-dir of the run that wrote "
            f"them)")
    if mine is None:
        mine = uuid.uuid4().hex
        _write_id(rd, mine)
    if owner is None or owner["run_id"] != mine:
        folder = checkpoint_path(rd.checkpoints)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / OWNER).write_text(json.dumps(
            {"run_id": mine, "run_dir": str(rd.remote or rd.local)}) + "\n")
    return mine


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
