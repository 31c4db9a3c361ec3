"""Where a run writes: a local directory, or a bucket (``gs://...``) mirrored from one.

Orbax writes checkpoints to a bucket directly (every host its own shards). The small files
(``config.yaml``, ``metrics.jsonl``, TensorBoard events, eval and summary JSON) are appended
to as the run goes, which object stores cannot do, so they are written locally and copied
to the bucket by process 0 at every checkpoint and at the end; ``--resume`` pulls them back
first.

One writer per run directory: ``lock_run_dir`` takes an advisory lock (``flock``) on
``RUN/.lock`` for the run's life; the OS drops it when the process ends, however it ends.
A bucket run locks its local folder (object stores have no locks).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from etils import epath

from tppo_jax.config import ConfigError

log = logging.getLogger(__name__)

LOCK = ".lock"  # RUN/.lock: the advisory lock of the run's one writer
# The logs a training run writes into its directory (besides config.yaml, the warm-start or
# model files, and checkpoints): what a new run must not append to, and what --start-over
# moves aside (wandb_id: the W&B run a resume continues, runs/wandb_log.py).
LOGS = ("metrics.jsonl", "samples.jsonl", "eval_before.json", "summary.json",
        "value_pretrain.jsonl", "tensorboard", "wandb_id")
# Errors of a write that found no room: the disk, the user's quota, the largest file allowed.
DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


class RunDirError(ConfigError):
    """The run directory cannot be used as asked (busy, or holding another run); one line."""

ENV_LOCAL_RUNS = "TPPO_LOCAL_RUNS"  # local parent of bucket runs' log folders (default runs/)


def is_url(path: str | os.PathLike) -> bool:
    return "://" in str(path)


@dataclass(frozen=True)
class RunDir:
    local: Path  # logs, metrics, summaries
    remote: str | None  # bucket URL the local files are mirrored to
    checkpoints: str  # Orbax directory (local path or URL)


def resolve_run_dir(run_dir: str | os.PathLike, checkpoint_dir: str = "") -> RunDir:
    """A local run dir as is (made absolute); a URL gets a local folder named after it
    (under ``$TPPO_LOCAL_RUNS``, default ``runs/``) and its checkpoints in the bucket."""
    if not is_url(run_dir):
        local = Path(run_dir).absolute()
        return RunDir(local, None, checkpoint_dir or str(local / "checkpoints"))
    remote = str(run_dir).rstrip("/")
    name = PurePosixPath(remote.split("://", 1)[1]).name or "run"
    local = (Path(os.environ.get(ENV_LOCAL_RUNS, "runs")) / name).absolute()
    return RunDir(local, remote, checkpoint_dir or f"{remote}/checkpoints")


def _files(root: epath.Path, skip: str) -> list[epath.Path]:
    """Every file under ``root`` except the ``skip`` folder and the lock (each machine's
    own; walked with ``iterdir``: epath refuses recursive globs on buckets)."""
    out, todo = [], [root]
    while todo:
        for p in todo.pop().iterdir():
            if p.is_dir():
                if not (p.parent == root and p.name == skip):
                    todo.append(p)
            elif not (p.parent == root and p.name == LOCK):
                out.append(p)
    return out


def copy_tree(src: str | os.PathLike, dst: str | os.PathLike, *, skip: str = "checkpoints"
              ) -> int:
    """Copies every file under ``src`` to ``dst`` (either may be a URL), leaving out the
    ``skip`` folder; returns the number of files copied."""
    src_p, dst_p = epath.Path(src), epath.Path(dst)
    if not src_p.exists():
        return 0
    files = _files(src_p, skip)
    for f in files:
        target = dst_p / f.relative_to(src_p)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(f.read_bytes())
    return len(files)


def mirror(rd: RunDir) -> None:
    """Local logs -> bucket (no-op for a local run). A failed copy is logged, not fatal:
    the next checkpoint copies again and the local files stay."""
    if rd.remote is None:
        return
    try:
        n = copy_tree(rd.local, rd.remote)
        log.info("mirrored %d files to %s", n, rd.remote)
    except Exception as e:  # network, permissions: keep training
        log.warning("could not mirror %s to %s: %s", rd.local, rd.remote, e)


def pull(rd: RunDir, only: str | None = None) -> None:
    """Bucket files -> local before a resume (no-op for a local run); ``only`` limits it
    to one sub-folder."""
    if rd.remote is not None:
        src, dst = (rd.remote, rd.local) if only is None else (
            f"{rd.remote}/{only}", rd.local / only)
        n = copy_tree(src, dst)
        log.info("pulled %d files from %s to %s", n, src, dst)


# ---- one writer ------------------------------------------------------------------------
# run dir -> [lock fd, holds, lends]: a hold taken with ``lend`` (the CLI's, around its one
# Trainer) lets exactly one more hold in; any other second hold in this process is refused,
# as a second process is (two Trainers on one run dir both train and save the same steps).
_HELD: dict[Path, list[int]] = {}


def lock_run_dir(local: Path, *, lend: bool = False) -> Callable[[], None]:
    """Takes ``local/.lock`` for this process and returns the function that lets go.
    ``RunDirError`` naming the holder (pid, host, start time) when another process holds
    it, and when this process holds it already, unless that hold was taken with ``lend``
    and has not lent it yet (the command line holds the lock around the set-up's own)."""
    key = Path(local).absolute()
    if key in _HELD:
        held = _HELD[key]
        if not (held[2] and held[1] == 1):
            raise RunDirError(f"{key} is in use by another Trainer in this process: one live "
                              f"trainer per run dir; close the first (trainer.close(), or "
                              f"end its with-block), or choose another run dir")
        held[1] += 1
        return _once(key)
    key.mkdir(parents=True, exist_ok=True)
    fd = os.open(key / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        raise RunDirError(f"{key} is in use by another tppo train ({holder}); wait for it "
                          f"to end, or choose another --run-dir") from None
    except OSError as e:  # a file system without flock (some network mounts): go on unlocked
        log.warning("could not lock %s (%s): nothing stops a second writer", key / LOCK,
                    e.strerror)
    os.ftruncate(fd, 0)
    os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                             "started": time.strftime("%Y-%m-%d %H:%M:%S")}).encode())
    _HELD[key] = [fd, 1, int(lend)]
    return _once(key)


def _once(key: Path) -> Callable[[], None]:
    """The release of one hold: a second call of it is a no-op (not another hold's)."""
    done = []

    def release() -> None:
        if not done:
            done.append(True)
            _release(key)
    return release


def _holder(fd: int) -> str:
    """The lock holder as it described itself: ``pid 123 on host h since 2025-...``."""
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f"pid {info['pid']} on {info['host']} since {info['started']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "holder unknown"


def _release(key: Path) -> None:
    held = _HELD.get(key)
    if held is None:
        return
    held[1] -= 1
    if held[1] == 0:
        del _HELD[key]
        with contextlib.suppress(OSError):
            os.ftruncate(held[0], 0)  # a reader of a stale file finds no holder named
        os.close(held[0])  # closing the last descriptor releases the flock


# ---- another run's logs -----------------------------------------------------------------
def found_logs(rd: RunDir) -> list[str]:
    """The logs a run dir holds (``metrics.jsonl (8 rows)``, ``summary.json``): its local
    folder, and a bucket run's bucket (a resume on a fresh machine pulls them later)."""
    roots = [epath.Path(rd.local)] + ([epath.Path(rd.remote)] if rd.remote else [])
    for root in roots:
        found = [_describe(root / name) for name in LOGS if name != "tensorboard"]
        found = [f for f in found if f]
        if found:
            return found
    return []


def _describe(path: epath.Path) -> str | None:
    """``name`` (``name (N rows)`` for JSONL) when ``path`` is a non-empty file, else None."""
    try:
        if not path.is_file():
            return None
        text = path.read_text()
    except (OSError, UnicodeDecodeError):
        return path.name  # there, unreadable: still another run's
    if not text.strip():
        return None
    if path.name.endswith(".jsonl"):
        return f"{path.name} ({len(text.splitlines())} rows)"
    return path.name


def set_aside_logs(local: Path) -> Path | None:
    """Moves the logs of the run in ``local`` (and its config.yaml) into
    ``local/replaced-<time>/``, so a run started over neither appends to them nor loses
    them; returns that folder (None when there was nothing to move)."""
    names = [n for n in (*LOGS, "config.yaml") if (Path(local) / n).exists()]
    if not names:
        return None
    dest = Path(local) / time.strftime("replaced-%Y%m%d-%H%M%S")
    while dest.exists():
        dest = dest.with_name(dest.name + "+")
    dest.mkdir()
    for n in names:
        os.replace(Path(local) / n, dest / n)
    log.warning("start over: moved %s to %s", ", ".join(names), dest)
    return dest


def write_atomic(path: Path, text: str) -> None:
    """Writes ``path`` whole or not at all (a temporary file renamed over it): a full disk
    or a kill mid-write leaves the previous version, never a truncated one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
