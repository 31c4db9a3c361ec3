"""`tppo plot RUN_DIR [RUN_DIR ...]`: PNG charts of a run's metrics.jsonl (several runs overlay)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

PANELS = (("reward_mean", "reward"), ("accuracy", "train accuracy (finished rows, %)"),
          ("response_len_mean", "response length (finished)"), ("occupancy", "slot occupancy"))


def read_metrics(run_dir: Path) -> list[dict]:
    """The rows of ``RUN_DIR/metrics.jsonl``. A line that is not a JSON object (a run killed
    mid-write leaves a partial last line; a hand-edited file anything) is skipped, with one
    warning on stderr naming the first few such lines."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir}: no metrics.jsonl (is this a run directory?)")
    rows, bad = [], []
    with path.open("rb") as f:
        for i, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            row = _parse_row(raw)
            if row is None:
                bad.append(i)
            else:
                rows.append(row)
    if bad:
        first = ", ".join(map(str, bad[:5])) + (", ..." if len(bad) > 5 else "")
        print(f"warning: {path}: {len(bad)} unreadable line(s) skipped (line {first})",
              file=sys.stderr)
    return rows


def _parse_row(raw: bytes) -> dict | None:
    """One metrics line as a dict, or None when it is not a JSON object."""
    try:
        row = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        # ValueError covers JSONDecodeError and an int over Python's 4300-digit limit
        return None
    return row if isinstance(row, dict) else None


def _is_number(v: object) -> bool:
    """A finite number a chart can place (an int past float range is not one)."""
    if not isinstance(v, int | float) or isinstance(v, bool):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


def _smooth(ys: list[float], k: int) -> list[float]:
    out, acc = [], []
    for y in ys:
        acc.append(y)
        acc = acc[-k:]
        out.append(sum(acc) / len(acc))
    return out


def plot_runs(run_dirs: list[Path], out_dir: Path, *, smooth: int = 5) -> list[Path]:
    """Writes ``metrics_vs_step.png`` and ``metrics_vs_time.png`` into ``out_dir``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {str(d): read_metrics(d) for d in run_dirs}
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for xkey, xlabel, name in (("step", "step", "metrics_vs_step.png"),
                               ("wall_time", "wall-clock (s)", "metrics_vs_time.png")):
        fig, axes = plt.subplots(2, 2, figsize=(11, 7))
        for ax, (key, title) in zip(axes.flat, PANELS, strict=True):
            for label, rows in runs.items():
                pts = [(r[xkey], r[key]) for r in rows
                       if _is_number(r.get(xkey)) and _is_number(r.get(key))]
                if pts:
                    xs, ys = zip(*pts, strict=True)
                    ax.plot(xs, _smooth(list(ys), smooth), label=Path(label).name)
            ax.set_title(title)
            ax.set_xlabel(xlabel)
            ax.grid(alpha=0.3)
        axes.flat[0].legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / name
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
