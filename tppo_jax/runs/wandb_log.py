"""Weights & Biases beside TensorBoard (``logging.wandb: true``), for ``MetricsWriter``.

The run's W&B id is kept in ``RUN/wandb_id``, so ``tppo train --resume`` continues the same
W&B run (``resume="allow"``) and ``--start-over`` (which moves the file aside) starts a new
one. W&B is a mirror, like TensorBoard: ``wandb`` is imported only when enabled, and any
failure of it (not installed, not logged in, a network error mid-run) turns it off with one
warning while ``metrics.jsonl`` goes on. wandb's own files go where wandb puts them
(``WANDB_DIR``, default ``./wandb``); ``WANDB_MODE=offline`` runs are synced with
``wandb sync``.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tppo_jax.runs.run_dir import write_atomic

if TYPE_CHECKING:
    from tppo_jax.config import Config

log = logging.getLogger(__name__)

ID_FILE = "wandb_id"  # RUN/wandb_id: the W&B run this run directory logs to
SAMPLE_COLUMNS = ("prompt", "completion", "answer", "reward", "reason")


@dataclass(frozen=True)
class WandbSettings:
    """What ``wandb.init`` is given; None fields leave wandb to its env vars and defaults."""

    project: str | None = None
    name: str | None = None
    entity: str | None = None
    config: dict[str, Any] = field(default_factory=dict)  # the run's config, as logged


def wandb_settings(cfg: Config) -> WandbSettings | None:
    """``cfg.logging``'s W&B settings, or None when ``logging.wandb`` is off."""
    lg = cfg.logging
    if not lg.wandb:
        return None
    return WandbSettings(lg.wandb_project, lg.wandb_name, lg.wandb_entity, cfg.to_dict())


class WandbLogger:
    """One W&B run: scalars per step, sampled completions as a table. Never raises: the
    first failure is said once and turns it off (``run`` is then None)."""

    def __init__(self, run_dir: Path, settings: WandbSettings) -> None:
        self.run: Any = None
        self.next_step = 0  # the lowest step W&B still takes (its steps only go up)
        try:
            self.run = _init(Path(run_dir), settings)
            self.next_step = int(self.run.step)  # a resumed run's: past what it has
        except Exception as e:  # not installed, no login in online mode, a bad project name
            self._off("could not start", e)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        if self._accepts(step):
            self._call("log", scalars, step=step)

    def log_samples(self, step: int, samples: list[dict[str, Any]]) -> None:
        """The step's graded completions as a ``wandb.Table`` under ``samples``."""
        if not self._accepts(step):
            return
        try:
            import wandb

            rows = [[step, *(_cell(s.get(c)) for c in SAMPLE_COLUMNS)] for s in samples]
            table = wandb.Table(columns=["step", *SAMPLE_COLUMNS], data=rows)
        except Exception as e:
            self._off("could not build the samples table", e)
            return
        self._call("log", {"samples": table}, step=step)

    def close(self) -> None:
        run, self.run = self.run, None
        if run is not None:
            try:
                run.finish()
            except Exception as e:
                log.warning("wandb: could not finish the run (%s)", _one_line(e))

    def _accepts(self, step: int) -> bool:
        """Whether ``step`` can still be logged. W&B refuses (with a warning per call) steps
        below its last one, so a resumed run's re-run steps, logged before the kill, keep
        their first values there and are not sent again."""
        return self.run is not None and step >= self.next_step

    def _call(self, name: str, *args: Any, step: int) -> None:
        try:
            getattr(self.run, name)(*args, step=step)
            self.next_step = step
        except Exception as e:
            self._off(f"{name} failed", e)

    def _off(self, what: str, e: BaseException) -> None:
        log.warning("wandb: %s (%s); W&B logging is off, metrics.jsonl goes on", what,
                    _one_line(e))
        run, self.run = self.run, None
        if run is not None:
            with contextlib.suppress(Exception):
                run.finish(exit_code=1)


def _init(run_dir: Path, s: WandbSettings) -> Any:
    """``wandb.init`` for ``run_dir``: the W&B run of ``RUN/wandb_id`` when there is one (a
    resume), else a new run whose id is then written there."""
    import wandb

    id_file = run_dir / ID_FILE
    run_id = id_file.read_text().strip() if id_file.is_file() else None
    # WANDB_DIR / WANDB_MODE read now, not when this process first touched wandb: its
    # settings are process-wide, so a notebook's second run would keep the first's.
    run = wandb.init(project=s.project, name=s.name, entity=s.entity, id=run_id or None,
                     resume="allow", reinit="create_new", dir=os.environ.get("WANDB_DIR"),
                     mode=os.environ.get("WANDB_MODE"))
    try:
        # after init, so a resumed run takes the config it runs with (lr changed on resume)
        run.config.update(s.config, allow_val_change=True)
        if run.id != run_id:
            write_atomic(id_file, f"{run.id}\n")
    except BaseException:
        with contextlib.suppress(Exception):
            run.finish(exit_code=1)
        raise
    log.info("wandb: logging to run %s (%s)", run.id, getattr(run, "url", None) or "offline")
    return run


def _cell(value: Any) -> Any:
    """A table cell: numbers as they are, anything else as text."""
    return value if isinstance(value, int | float) and not isinstance(value, bool) else (
        "" if value is None else str(value))


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())[:200]
    return f"{type(e).__name__}: {text}" if text else type(e).__name__
