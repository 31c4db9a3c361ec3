"""The Python API: train from a notebook or a script.

    import tppo_jax
    cfg = tppo_jax.load_config("smoke", ["train.steps=2"])
    summary = tppo_jax.fit(cfg, "runs/api")            # or fit("smoke", "runs/api", overrides=...)
    summary["eval_after"]["accuracy"]                  # percent

``fit`` is what ``tppo train`` runs (same run directory, claim, checkpoints, metrics and
summary, and the same before -> after line at the end). It works from a plain script without an
``if __name__ == "__main__":`` guard: the grading workers never re-run the script
(``rewards/workers.py``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from tppo_jax.config import Config, ConfigError, load_config


def fit(config: Config | str | Path | None = None, run_dir: str | Path | None = None, *,
        overrides: list[str] | dict[str, Any] | None = None, resume: bool = False,
        progress: bool = True) -> dict[str, Any]:
    """Trains a policy and returns the run's summary (also written to ``summary.json``).

    Args:
      config: a ``Config`` (``load_config``), a YAML path or shipped config name
        (``"smoke"``, ``"qwen25_05b_gsm8k"``), or None for the embedded default.
      run_dir: where the run writes (a path or ``gs://`` URL); default ``runs/<config name>``.
        A new run refuses a directory that holds another run unless ``resume``.
      overrides: ``["train.steps=10", ...]`` or ``{"train.steps": 10}``, applied on top of
        the named ``config`` (not with a ``Config``: give those to ``load_config``).
      resume: continue the run in ``run_dir`` from its latest checkpoint, as ``tppo train
        --resume`` does: with the run's own ``config.yaml`` (``overrides`` on top; a named
        ``config``'s differences from it), refusing a change to a key the checkpoints, the
        warm-start or the data order depend on.
      progress: progress bars and the held-out accuracy's before -> after line.

    Returns:
      ``{"eval_before", "eval_after", "steps", "preempted", "train_seconds", "run_dir"}``;
      the evals hold accuracies in percent (``accuracy``, ``greedy_accuracy``, ...).

    Raises:
      ConfigError: a bad config or override (one-line message).
    """
    from tppo_jax.backend_env import cpu_only_where_nothing_else
    from tppo_jax.runs.run_config import resume_config

    cpu_only_where_nothing_else()  # no libtpu start-up noise where there is no TPU
    from tppo_jax.trainer.trainer import train

    ov = _override_list(overrides)
    try:
        if isinstance(config, Config):
            if ov:
                raise ValueError("fit(Config, overrides=...): apply overrides when loading, "
                                 "load_config(name, overrides), or pass the config's name")
            cfg, name = config, "api"
        else:
            name = Path(str(config)).stem if config else "default"
        run_dir = run_dir if run_dir is not None else Path("runs") / name
        if not isinstance(config, Config):
            # As ``tppo train --resume``: the run's own config.yaml, overrides on top (or
            # a named config's differences from it); a Config is checked by the Trainer.
            cfg = (resume_config(str(run_dir), None if config is None else str(config), ov)
                   if resume else None) or load_config(config, ov)
        summary = train(cfg, run_dir, resume=resume, progress=progress)
    except ConfigError as e:
        e.args = (api_terms(str(e)),)  # RunDirError too: the API's words for the CLI's flags
        raise
    if progress and not summary["preempted"]:
        print(before_after(cfg, summary), flush=True)
    return summary


# The command line's flags in a refusal's advice, as ``fit``'s arguments.
_API_TERMS = ((re.compile(r"--run-dir ((?:/|\w+://)[^\s;,)]*)"), r"run_dir=\1"),
              (re.compile(r"--run-dir\b"), "run_dir"), (re.compile(r"--resume\b"), "resume=True"),
              (re.compile(r"--start-over\b"), "`tppo train --start-over`"))


def api_terms(message: str) -> str:
    """A refusal written for ``tppo train`` in ``fit``'s terms: ``--resume`` is
    ``resume=True``, ``--run-dir X`` is ``run_dir=X``."""
    for pattern, repl in _API_TERMS:
        message = pattern.sub(repl, message)
    return message


def before_after(cfg: Config, summary: dict[str, Any]) -> str:
    """The line a finished run ends with: held-out accuracy before -> after training."""
    b, a = summary["eval_before"], summary["eval_after"]
    return (f"held-out accuracy, avg@{cfg.train.eval_samples} sampled at "
            f"T={cfg.rollout.temperature}: {b['accuracy']:.1f}% -> {a['accuracy']:.1f}%; "
            f"greedy: {b['greedy_accuracy']:.1f}% -> {a['greedy_accuracy']:.1f}%  "
            f"({summary['steps']} steps, {summary['train_seconds']:.0f} s, "
            f"run dir {summary['run_dir']})")


def _override_list(overrides: list[str] | dict[str, Any] | None) -> list[str]:
    if overrides is None:
        return []
    if isinstance(overrides, dict):
        import json

        # JSON values are YAML values: numbers, booleans, null and strings as written.
        return [f"{k}={json.dumps(v)}" for k, v in overrides.items()]
    return list(overrides)


__all__ = ["Config", "fit", "load_config"]
