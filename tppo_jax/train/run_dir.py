"""Where a run writes: a local directory, or a bucket (``gs://...``) mirrored from one.

Orbax writes checkpoints to a bucket directly (every host its own shards). The small files
(``config.yaml``, ``metrics.jsonl``, TensorBoard events, eval and summary JSON) are appended
to as the run goes, which object stores cannot do, so they are written locally and copied
to the bucket by process 0 at every checkpoint and at the end; ``--resume`` pulls them back
first.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from etils import epath

log = logging.getLogger(__name__)

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
    """Every file under ``root`` except the ``skip`` folder (walked with ``iterdir``: epath
    refuses recursive globs on buckets)."""
    out, todo = [], [root]
    while todo:
        for p in todo.pop().iterdir():
            if p.is_dir():
                if not (p.parent == root and p.name == skip):
                    todo.append(p)
            else:
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
