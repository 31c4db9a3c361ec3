"""Per-step metrics: JSONL (always), TensorBoard events (optional). Process 0 writes.

Also a few sampled completions per step (``samples.jsonl``, and TensorBoard text), so a run
shows what the model writes, not only how it scores."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import jax


def _clean(v: Any) -> Any:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return v
    return f if math.isfinite(f) else str(f)


class MetricsWriter:
    """Appends one JSON object per step to ``metrics.jsonl`` and mirrors scalars to TensorBoard."""

    def __init__(self, run_dir: Path, *, tensorboard: bool = True,
                 resume_step: int | None = None) -> None:
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

            self.tb = SummaryWriter(str(Path(run_dir) / "tensorboard"))

    def _truncate(self, step: int) -> None:
        """Drops rows past the checkpoint being resumed (a killed run may have logged steps
        it never saved) and continues the wall clock where the kept rows left off."""
        kept = []
        for line in self.path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by the kill
            if row.get("step", 0) <= step:
                kept.append(row)
        self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        if kept:
            self.last = kept[-1]
            self.t0 = time.time() - float(kept[-1].get("wall_time", 0.0))

    def write(self, step: int, metrics: dict[str, Any]) -> dict[str, Any]:
        row = {"step": step, "wall_time": time.time() - self.t0}
        row.update({k: _clean(v) for k, v in metrics.items()})
        if self.enabled:
            with self.path.open("a") as f:
                f.write(json.dumps(row) + "\n")
            if self.tb is not None:
                for k, v in row.items():
                    if isinstance(v, float | int) and k != "step":
                        self.tb.add_scalar(k, v, step)
        return row

    def write_samples(self, step: int, samples: list[dict[str, Any]]) -> None:
        """One JSON line per sample (``step`` added); TensorBoard gets them as markdown text."""
        if not (self.enabled and samples):
            return
        with self.samples_path.open("a") as f:
            for s in samples:
                f.write(json.dumps({"step": step, **s}) + "\n")
        if self.tb is not None:
            self.tb.add_text("samples", "\n\n---\n\n".join(_markdown(s) for s in samples), step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def _markdown(sample: dict[str, Any]) -> str:
    """A sample as TensorBoard markdown: the texts in code blocks, so LaTeX stays readable."""
    head = ", ".join(f"{k}: {sample[k]}" for k in ("reward", "reason", "answer") if k in sample)
    return (f"**{head}**\n\n```\n{sample.get('prompt', '')}\n```\n\n"
            f"```\n{sample.get('completion', '')}\n```")


def _truncate_jsonl(path: Path, step: int) -> None:
    """Keeps the rows of ``path`` up to ``step`` (a resumed run re-logs the steps after)."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line).get("step", 0) <= step:
                kept.append(line + "\n")
        except json.JSONDecodeError:
            continue
    path.write_text("".join(kept))
