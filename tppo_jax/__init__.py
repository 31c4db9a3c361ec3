"""tppo-jax: Truncated PPO (T-PPO) and VAPO for RL of reasoning LLMs, in JAX/Flax NNX."""

from pathlib import Path as _Path

# pyproject.toml ships the top-level kernels/, configs/ and benchmarks/ folders as
# tppo_jax.kernels / .configs / .benchmarks. A source checkout on sys.path (running from the
# repository root, or PYTHONPATH=.) would hide them; adding the checkout's root to this
# package's search path maps them the same way. An installed wheel has no pyproject.toml
# beside it, so this is inert there.
_root = _Path(__file__).resolve().parent.parent
if (_root / "pyproject.toml").is_file() and (_root / "kernels" / "__init__.py").is_file():
    __path__.append(str(_root))  # noqa: F821 -- a package's __path__ is defined at import
