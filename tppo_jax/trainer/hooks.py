"""Where a caller acts on a training run and when the loop stops: ``TrainHooks`` (a test's or
the CLI's fault injection), the held-out eval's cadence (``eval_due``) and the SIGTERM
handler that asks the loop to save and leave (``StopOnSignal``)."""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass

from tppo_jax.config import TrainConfig
from tppo_jax.learner import Targets

log = logging.getLogger("tppo_jax.trainer.trainer")  # the loop's messages, one logger


@dataclass
class TrainHooks:
    """Where a caller (a test, the CLI's fault injection) acts on a run.

    before_update: ``(step, targets) -> targets`` the updates of 0-based ``step`` train on.
    """

    before_update: Callable[[int, Targets], Targets] | None = None


def nan_updates_from(step: int) -> TrainHooks:
    """Fault injection: every update from (1-based) ``step`` on sees NaN advantages and
    returns (the reliability tests' divergence)."""
    def poison(i: int, targets: Targets) -> Targets:
        if i + 1 < step:
            return targets
        return targets.replace(advantages=targets.advantages * float("nan"),
                               returns=targets.returns * float("nan"))

    return TrainHooks(before_update=poison)


def eval_due(tc: TrainConfig, step: int, train_time: float, last_eval: float) -> bool:
    """Whether a held-out eval follows ``step``: every ``eval_every`` steps, or once
    ``eval_every_s`` seconds of training wall-clock passed since the last one."""
    by_steps = bool(tc.eval_every) and step % tc.eval_every == 0
    return by_steps or (tc.eval_every_s > 0 and train_time - last_eval >= tc.eval_every_s)


class StopOnSignal:
    """SIGTERM (preemption) asks the loop to finish the current step, checkpoint, and exit."""

    def __init__(self) -> None:
        self.requested = False
        self._old = None

    def __enter__(self) -> StopOnSignal:
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGTERM, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        log.warning("SIGTERM: finishing this step, saving a checkpoint, then exiting")
        self.requested = True

    def __exit__(self, *exc) -> None:
        if self._old is not None:
            signal.signal(signal.SIGTERM, self._old)


