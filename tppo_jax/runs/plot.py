"""`tppo plot RUN_DIR [RUN_DIR ...]`: PNG charts of a run's metrics.jsonl (several runs overlay)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

# (title, metrics.jsonl keys drawn in it); one 3 x 3 figure per x axis.
PANELS = (
    ("reward (finished rows)", ("reward_mean",)),
    ("train accuracy (finished rows, %)", ("accuracy",)),
    ("held-out accuracy (%)", ("eval_accuracy", "eval_greedy_accuracy")),
    ("losses", ("policy_loss", "value_loss")),
    ("KL and entropy", ("approx_kl", "entropy")),
    ("critic explained variance", ("explained_variance",)),
    ("clip fractions", ("clip_frac", "value_clip_frac")),
    ("response length (finished)", ("response_len_mean",)),
    ("slot occupancy", ("occupancy",)),
)
HELD_OUT = "held-out accuracy (%)"  # its points are evals: drawn as markers, not smoothed


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


def read_evals(run_dir: Path) -> list[dict]:
    """The held-out evals of ``RUN_DIR/evals.jsonl`` (before, during, after training) as
    rows with ``eval_<key>`` names, as the during ones appear in ``metrics.jsonl``."""
    path = Path(run_dir) / "evals.jsonl"
    if not path.is_file():
        return []
    rows = [_parse_row(raw) for raw in path.read_bytes().splitlines() if raw.strip()]
    return [{"step": r.get("step"), "wall_time": r.get("wall_time"),
             **{f"eval_{k}": v for k, v in r.items() if k not in ("step", "wall_time")}}
            for r in rows if r is not None]


def plot_runs(run_dirs: list[Path], out_dir: Path, *, smooth: int = 5) -> list[Path]:
    """Writes ``metrics_vs_step.png`` and ``metrics_vs_time.png`` into ``out_dir``: 3 x 3
    panels (``PANELS``), each line a moving mean over ``smooth`` steps (stated in the
    figure), held-out evals (``evals.jsonl``, else ``metrics.jsonl``'s) as raw markers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {str(d): read_metrics(d) for d in run_dirs}
    evals = {str(d): read_evals(d) for d in run_dirs}
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for xkey, xlabel, name in (("step", "step", "metrics_vs_step.png"),
                               ("wall_time", "wall-clock (s)", "metrics_vs_time.png")):
        fig, axes = plt.subplots(3, 3, figsize=(15, 10.5))
        for ax, (title, keys) in zip(axes.flat, PANELS, strict=True):
            held_out = title == HELD_OUT
            for label, rows in runs.items():
                src = (evals[label] or rows) if held_out else rows
                for key in keys:
                    pts = [(r[xkey], r[key]) for r in src
                           if _is_number(r.get(xkey)) and _is_number(r.get(key))]
                    if not pts:
                        continue
                    xs, ys = zip(*pts, strict=True)
                    tag = Path(label).name + (f" {key}" if len(keys) > 1 else "")
                    if held_out:
                        ax.plot(xs, ys, marker="o", label=tag)
                    else:
                        ax.plot(xs, _smooth(list(ys), smooth), label=tag)
            ax.set_title(title)
            ax.set_xlabel(xlabel)
            ax.grid(alpha=0.3)
            if len(keys) > 1 or len(runs) > 1:
                ax.legend(fontsize=7)
        fig.suptitle(f"lines: moving mean over {smooth} step(s) (--smooth); held-out evals: "
                     f"raw points", fontsize=10)
        fig.tight_layout()
        path = out_dir / name
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
