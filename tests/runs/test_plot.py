"""``tppo plot``: 3 x 3 panels vs step and wall-clock, held-out evals from evals.jsonl as
raw points, and the smoothing stated in the figure."""

import json

import pytest

from tppo_jax.runs.plot import PANELS, plot_runs, read_evals


def test_plot_panels_evals_and_smoothing_note(tmp_path, monkeypatch):
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": s, "wall_time": 2.0 * s, "reward_mean": s / 10, "accuracy": 10.0 * s,
             "policy_loss": 1.0 / s, "value_loss": 0.5, "approx_kl": 0.01, "entropy": 1.0,
             "explained_variance": 0.1 * s, "clip_frac": 0.2, "value_clip_frac": 0.1,
             "response_len_mean": 20.0, "occupancy": 0.9} for s in (1, 2, 3)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "evals.jsonl").write_text(
        json.dumps({"step": 0, "which": "before", "wall_time": 0.0, "accuracy": 5.0,
                    "greedy_accuracy": 7.0}) + "\n" +
        json.dumps({"step": 3, "which": "after", "wall_time": 6.0, "accuracy": 25.0,
                    "greedy_accuracy": 30.0}) + "\n")
    assert [r["eval_accuracy"] for r in read_evals(run)] == [5.0, 25.0]

    import matplotlib.figure

    titles, drawn = [], {}
    real = matplotlib.figure.Figure.savefig

    def spy(fig, path, **kw):  # what each saved figure holds
        titles.append(fig._suptitle.get_text())
        for ax in fig.axes:
            drawn[ax.get_title()] = [list(line.get_ydata()) for line in ax.get_lines()]
        return real(fig, path, **kw)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", spy)
    paths = plot_runs([run], run, smooth=2)
    assert [p.name for p in paths] == ["metrics_vs_step.png", "metrics_vs_time.png"]
    assert all(p.stat().st_size > 1000 for p in paths)
    assert len(PANELS) == 9 and set(drawn) == {t for t, _ in PANELS}
    assert all("moving mean over 2 step" in t for t in titles)
    assert drawn["held-out accuracy (%)"] == [[5.0, 25.0], [7.0, 30.0]]  # raw, not smoothed
    assert drawn["train accuracy (finished rows, %)"] == [[10.0, 15.0, 25.0]]  # mean of 2


def test_scheduled_lrs_warm_up_then_hold():
    from tppo_jax.config import load_config
    from tppo_jax.learner.state import scheduled_lrs

    cfg = load_config(None, ["optim.warmup_steps=2", "optim.policy_lr=1e-3",
                             "optim.value_lr=2e-3"])
    first, later = scheduled_lrs(cfg.optim, 1), scheduled_lrs(cfg.optim, 10)
    assert 0 < first["lr_policy"] < 0.9e-3  # still warming up after step 1 of 2
    assert later["lr_policy"] == pytest.approx(1e-3) and later["lr_value"] == pytest.approx(2e-3)
