"""Logging set up by the commands: one handler on the root logger writing to stderr."""

from __future__ import annotations

import logging
import sys

FORMAT = "%(levelname)s %(name)s: %(message)s"


class StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at emit time, not the stream it was made with: a
    caller that swaps stderr (a notebook cell, a test's capture, ``tppo_jax.fit`` in a script)
    and later closes its stream must not leave the root logger writing to a closed file."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def log_to_stderr(level: int, ours: int | None = None) -> None:
    """Root logger at ``level`` on stderr (replacing any handler: importing Orbax makes absl
    call ``basicConfig()`` first, which would turn ours into a no-op); ``tppo_jax`` loggers at
    ``ours`` when given."""
    logging.basicConfig(level=level, format=FORMAT, handlers=[StderrHandler()], force=True)
    if ours is not None:
        logging.getLogger("tppo_jax").setLevel(ours)
