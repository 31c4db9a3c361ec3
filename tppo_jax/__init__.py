"""tppo-jax: Truncated PPO (T-PPO) and VAPO for RL of reasoning LLMs, in JAX/Flax NNX.

The Python API (``tppo_jax.api``): ``tppo_jax.fit(config, run_dir, overrides=...)`` trains
and returns the run's summary; ``tppo_jax.load_config(name_or_path, overrides)`` builds a
``Config``. They are imported on first use, so ``import tppo_jax`` stays cheap (no jax).
"""

from typing import Any as _Any

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
