"""Per-step metrics: JSONL (always), TensorBoard events and W&B (optional). Process 0 writes.

Also a few sampled completions per step (``samples.jsonl``, TensorBoard text, a W&B table), so
a run shows what the model writes, not only how it scores.

A row is appended whole or not at all (``append_whole``): on a full disk the file keeps its
earlier rows and parses; the failure is an ``OSError`` naming the file. TensorBoard events
are a mirror: a write that fails there turns TensorBoard off with one warning, never
blocking or stopping the run; W&B likewise (``runs/wandb_log.py``)."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax

from tppo_jax.runs.run_dir import write_atomic

if TYPE_CHECKING:
    from tppo_jax.runs.wandb_log import WandbSettings

log = logging.getLogger(__name__)


def _clean(v: Any) -> Any:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return v
    return f if math.isfinite(f) else str(f)


def append_whole(path: Path, text: str) -> None:
    """Appends ``text`` with as few ``os.write`` calls as the OS allows; when one fails
    (ENOSPC mid-row: a short write, then the error) the file is cut back to its size
    before, so a reader never sees half a row. Raises the ``OSError`` with ``path`` set."""
    data = text.encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        try:
            done = 0
            while done < len(data):
                done += os.write(fd, data[done:])
        except OSError as e:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, size)
            raise OSError(e.errno, e.strerror, str(path)) from None
    finally:
        os.close(fd)


class MetricsWriter:
    """Appends one JSON object per step to ``metrics.jsonl`` and mirrors scalars to
    TensorBoard and (``wandb`` settings given) Weights & Biases."""

    def __init__(self, run_dir: Path, *, tensorboard: bool = True,
                 resume_step: int | None = None, wandb: WandbSettings | None = None) -> None:
        self.enabled = jax.process_index() == 0
        self.path = Path(run_dir) / "metrics.jsonl"
        self.samples_path = Path(run_dir) / "samples.jsonl"
        self.t0 = time.time()
        self.last: dict[str, Any] = {}
        if resume_step is not None and self.path.exists() and self.enabled:
            self._truncate(resume_step)
            _truncate_jsonl(self.samples_path, resume_step)
        self.tb = None
        if self.enabled and tensorboard:
            from tensorboardX import SummaryWriter

            # max_queue=0: an unbounded queue, so an event writer that died (full disk)
            # never blocks the step that logs next; _tb_alive turns it off first.
            self.tb = SummaryWriter(str(Path(run_dir) / "tensorboard"), max_queue=0)
            self._tb_writes = [_guard_writes(w) for w in self.tb.all_writers.values()]
        self.wandb = None
        if self.enabled and wandb is not None:
            from tppo_jax.runs.wandb_log import WandbLogger

            self.wandb = WandbLogger(Path(run_dir), wandb)

    def _truncate(self, step: int) -> None:
        """Drops rows past the checkpoint being resumed (a killed run may have logged steps
        it never saved; the resumed run logs them again) and continues the wall clock where
        the kept rows left off. Every row up to ``step`` stays; the file is replaced whole."""
        rows = [r for r in map(json.loads, _kept_rows(self.path, step)) if isinstance(r, dict)]
        if rows:
            self.last = rows[-1]
            wall = self.last.get("wall_time")
            self.t0 = time.time() - (float(wall) if isinstance(wall, int | float) else 0.0)

    def write(self, step: int, metrics: dict[str, Any]) -> dict[str, Any]:
        row = {"step": step, "wall_time": time.time() - self.t0}
        row.update({k: _clean(v) for k, v in metrics.items()})
        if self.enabled:
            append_whole(self.path, json.dumps(row) + "\n")
            scalars = {k: v for k, v in row.items() if isinstance(v, float | int) and k != "step"}
            self._tb_scalars(scalars, step)
            if self.wandb is not None:
                self.wandb.log(step, scalars)
        return row

    def write_eval(self, step: int, which: str, result: dict[str, Any], *,
                   loggers: bool = True) -> None:
        """One held-out eval (``which``: before / during / after training, at ``step``) to
        ``evals.jsonl``, and with ``loggers`` its scalars to TensorBoard and W&B as
        ``eval_<key>`` at ``step`` (the during evals reach them through ``write``)."""
        if not self.enabled:
            return
        row = {"step": step, "which": which, "wall_time": time.time() - self.t0,
               **{k: _clean(v) for k, v in result.items()}}
        append_whole(self.path.with_name("evals.jsonl"), json.dumps(row) + "\n")
        if not loggers:
            return
        scalars = {f"eval_{k}": v for k, v in result.items()
                   if isinstance(v, float | int) and not isinstance(v, bool)}
        self._tb_scalars(scalars, step)
        if self.wandb is not None:
            self.wandb.log(step, scalars)

    def _tb_scalars(self, scalars: dict[str, float | int], step: int) -> None:
        """The scalars to TensorBoard under the names metrics.jsonl and W&B use: one event
        whose tags are the keys as they are (``eval_avg@4``; tensorboardX's ``add_scalar``
        would rename it ``eval_avg_4``, and TensorBoard shows any tag)."""
        if not scalars or not self._tb_alive():
            return
        from tensorboardX.proto.summary_pb2 import Summary

        summary = Summary(value=[Summary.Value(tag=k, simple_value=float(v))
                                 for k, v in scalars.items()])
        self.tb._get_file_writer().add_summary(summary, step)

    def write_samples(self, step: int, samples: list[dict[str, Any]]) -> None:
        """One JSON line per sample (``step`` added); TensorBoard gets them as markdown text,
        W&B as a table."""
        if not (self.enabled and samples):
            return
        append_whole(self.samples_path,
                     "".join(json.dumps({"step": step, **s}) + "\n" for s in samples))
        if self._tb_alive():
            self.tb.add_text("samples", "\n\n---\n\n".join(_markdown(s) for s in samples), step)
        if self.wandb is not None:
            self.wandb.log_samples(step, samples)

    def _tb_alive(self) -> bool:
        """False (and TensorBoard off, said once) once a write in its event thread failed."""
        if self.tb is None:
            return False
        if self._tb_failure() is None:
            return True
        self._tb_off()
        return False

    def _tb_failure(self) -> OSError | None:
        return next((g.error for g in self._tb_writes if g.error is not None), None)

    def _tb_off(self) -> None:
        log.warning("tensorboard: its event writer stopped (%s under %s); "
                    "TensorBoard events end here, metrics.jsonl goes on",
                    self._tb_failure().strerror or "a failed write", self.path.parent)
        tb, self.tb = self.tb, None
        with contextlib.suppress(OSError):
            tb.close()

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.close()
        tb, self.tb = self.tb, None
        if tb is None:
            return
        try:
            tb.close()  # flushes and joins the event thread: every queued write has been tried
        except OSError as e:  # the final flush on a full disk: the JSONL files are the record
            log.warning("tensorboard: could not flush its events (%s)", e.strerror or e)
            return
        if self._tb_failure() is not None:
            self.tb = tb
            self._tb_off()


class _GuardedWrites:
    """TensorBoard's record writer as its event thread sees it. The first failed write (a
    full disk) is kept in ``error`` and later events are dropped, so the thread neither dies
    with a traceback nor blocks a step; ``MetricsWriter`` reads ``error`` and says it once.
    Methods are looked up on the real writer at each call."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.error: OSError | None = None

    def write_event(self, event: Any) -> None:
        self._call("write_event", event)

    def flush(self) -> None:
        self._call("flush")

    def _call(self, name: str, *args: Any) -> None:
        if self.error is not None:
            return
        try:
            getattr(self.inner, name)(*args)
        except OSError as e:
            self.error = e


def _guard_writes(file_writer: Any) -> _GuardedWrites:
    thread = file_writer.event_writer._worker
    guard = _GuardedWrites(thread._record_writer)
    thread._record_writer = guard  # read at every event, so the swap holds from the next one
    return guard


def _markdown(sample: dict[str, Any]) -> str:
    """A sample as TensorBoard markdown: the texts in code blocks, so LaTeX stays readable."""
    head = ", ".join(f"{k}: {sample[k]}" for k in ("reward", "reason", "answer") if k in sample)
    return (f"**{head}**\n\n```\n{sample.get('prompt', '')}\n```\n\n"
            f"```\n{sample.get('completion', '')}\n```")


def _kept_rows(path: Path, step: int) -> list[str]:
    """Rewrites ``path`` (atomically) with its rows up to ``step`` and returns them. A line
    that does not parse (cut by a kill in an older version, bytes that are not UTF-8) is
    dropped, and said; a row whose step is not a number is kept (nothing says it is past
    ``step``)."""
    kept, cut = [], 0
    for line in path.read_bytes().decode("utf-8", errors="replace").splitlines():
        try:
            row = json.loads(line)
        except ValueError:  # not JSON, or an integer past Python's digit limit
            cut += 1
            continue
        row_step = row.get("step") if isinstance(row, dict) else None
        if not (type(row_step) in (int, float) and row_step > step):
            kept.append(line)
    if cut:
        log.warning("%s: dropped %d line(s) that do not parse", path, cut)
    write_atomic(path, "".join(f"{line}\n" for line in kept))
    return kept


def _truncate_jsonl(path: Path, step: int) -> None:
    """Keeps the rows of ``path`` up to ``step`` (a resumed run re-logs the steps after)."""
    if path.exists():
        _kept_rows(path, step)
