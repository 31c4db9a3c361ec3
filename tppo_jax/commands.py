"""Registers the subcommands backed by the rest of the package (train, eval, ...)."""

from __future__ import annotations

from collections.abc import Callable


def register_all(register: Callable) -> None:
    """Adds each implemented subcommand to the CLI."""
    return None
