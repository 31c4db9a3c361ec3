"""`tppo plot RUN_DIR [RUN_DIR ...]`: PNG charts of a run's metrics.jsonl (several runs overlay)."""

from __future__ import annotations

import json
from pathlib import Path

PANELS = (("reward_mean", "reward"), ("accuracy", "train accuracy (finished rows)"),
          ("response_len_mean", "response length (finished)"), ("occupancy", "slot occupancy"))


def read_metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{run_dir}: no metrics.jsonl (is this a run directory?)")
    rows = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            # A run killed mid-write leaves a partial last line; everything before it is good.
            print(f"warning: {path}:{i}: unreadable line skipped")
    return rows


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
                pts = [(r[xkey], r[key]) for r in rows if isinstance(r.get(key), int | float)]
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
