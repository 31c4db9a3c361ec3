"""The installed package's version (``tppo --version``, ``tppo_jax.__version__``)."""

from __future__ import annotations


def version() -> str:
    """The version pip installed (``pyproject.toml``'s), or ``unknown`` when run from a
    checkout that was never installed."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as _version

    try:
        return _version("tppo-jax")
    except PackageNotFoundError:
        return "unknown"
