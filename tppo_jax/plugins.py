"""Extensions a config names: ``package.module:function``, one rule for every key that takes one.

Two keys take a user's function this way: ``reward.fn`` (a reward function in place of
math-verify, ``rewards/custom.py``) and ``algo.advantage_baseline`` (an advantage estimator,
``learner/estimators.py``, which also takes a registered estimator's name). The module is found
as Python finds a script's: installed, on ``PYTHONPATH``, or in the working directory (the
``tppo`` entry point does not put that on ``sys.path``; ``import_module`` adds it as a last
resort). ``function`` may be dotted (``module:Class.method``).

Validation (``config_checks.check_plugin_path``) checks the shape when a config loads; the
function is imported where it is used (``load_plugin``), and every failure is one line naming
the key. Nothing here imports jax.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from typing import Any

from tppo_jax.config_checks import ConfigError, check_plugin_path


def import_module(module: str, cwd: str | None = None) -> Any:
    """``importlib.import_module``, with the working directory (``cwd``, default this
    process's) as a last resort: where ``python script.py`` / ``python -m`` find a module
    beside them."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        cwd = cwd or os.getcwd()
        if e.name != module.partition(".")[0] or cwd in sys.path:
            raise
        sys.path.append(cwd)
        return importlib.import_module(module)


def load_plugin(key: str, path: str, cwd: str | None = None) -> Callable[..., Any]:
    """The callable ``path`` (``package.module:function``) names, for config key ``key``
    (a module in ``cwd``, default the working directory, too); ``ConfigError`` in one line
    naming the key when it has no such shape, cannot be imported or is not callable."""
    module, name = check_plugin_path(key, path)
    try:
        fn = import_module(module, cwd)
        for part in name.split("."):
            fn = getattr(fn, part)
    except ModuleNotFoundError as e:
        raise ConfigError(f"{key}: cannot import {path}: no module named {e.name!r} (from "
                          f"{cwd or os.getcwd()}); put {module.replace('.', '/')}.py in the "
                          f"working directory, install it, or add its folder to PYTHONPATH"
                          ) from None
    except Exception as e:  # noqa: BLE001 -- any import-time error is the user's to fix
        why = " ".join(f"{type(e).__name__}: {e}".split())[:300]
        raise ConfigError(f"{key}: cannot import {path}: {why}") from None
    if not callable(fn):
        raise ConfigError(f"{key}: {path} is not callable")
    return fn
