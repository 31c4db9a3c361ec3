"""Arguments shared by the commands, and argparse ``type=`` checks for numeric ones.

A check raises ``argparse.ArgumentTypeError``: argparse then prints the usage and one
``tppo CMD: error: argument X: ...`` line and exits with 2, before the command runs.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from tppo_jax.config_checks import INT_MAX, quote


def add_config_args(p: argparse.ArgumentParser) -> None:
    """``--config FILE`` and ``key=value`` overrides, shared by every config-driven command."""
    p.add_argument("--config", default=None,
                   help="YAML file or shipped config name (default: the embedded default)")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="config overrides, e.g. rollout.window=64 train.steps=10")


def int_at_least(lo: int) -> Callable[[str], int]:
    """An argparse type: an integer in ``[lo, INT_MAX]``."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {quote(text)}") from None
        if not lo <= v <= INT_MAX:
            raise argparse.ArgumentTypeError(f"must be an integer in [{lo}, {INT_MAX}], got {v}")
        return v

    return parse


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)


def _finite(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {quote(text)}") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {quote(text)}")
    return v


def non_negative_float(text: str) -> float:
    """An argparse type: a finite number >= 0 (a temperature; 0 = greedy)."""
    v = _finite(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return v


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0 (a timeout in seconds)."""
    v = _finite(text)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return v


def top_p(text: str) -> float:
    """An argparse type: a nucleus-sampling mass in ``(0, 1]``."""
    v = _finite(text)
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return v
