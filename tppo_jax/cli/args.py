"""Arguments shared by the config-driven commands."""

from __future__ import annotations

import argparse


def add_config_args(p: argparse.ArgumentParser) -> None:
    """``--config FILE`` and ``key=value`` overrides, shared by every config-driven command."""
    p.add_argument("--config", default=None,
                   help="YAML file or shipped config name (default: the embedded default)")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="config overrides, e.g. rollout.window=64 train.steps=10")
