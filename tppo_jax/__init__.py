"""tppo-jax: Truncated PPO (T-PPO) and VAPO for RL of reasoning LLMs, in JAX/Flax NNX.

The Python API (``tppo_jax.api``): ``tppo_jax.fit(config, run_dir, overrides=...)`` trains
and returns the run's summary; ``tppo_jax.load_config(name_or_path, overrides)`` builds a
``Config``. They are imported on first use, so ``import tppo_jax`` stays cheap (no jax).
"""

from pathlib import Path as _Path
from typing import Any as _Any

# pyproject.toml ships the top-level kernels/, configs/ and benchmarks/ folders as
# tppo_jax.kernels / .configs / .benchmarks. A source checkout on sys.path (running from the
# repository root, or PYTHONPATH=.) would hide them; adding the checkout's root to this
# package's search path maps them the same way. An installed wheel has no pyproject.toml
# beside it, so this is inert there.
_root = _Path(__file__).resolve().parent.parent
if (_root / "pyproject.toml").is_file() and (_root / "kernels" / "__init__.py").is_file():
    __path__.append(str(_root))  # noqa: F821 -- a package's __path__ is defined at import

_API = ("fit", "load_config", "Config")


def __getattr__(name: str) -> _Any:
    if name in _API:
        from tppo_jax import api

        return getattr(api, name)
    if name == "__version__":
        from tppo_jax.version import version

        return version()
    raise AttributeError(f"module 'tppo_jax' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_API, "__version__"])
