"""User reward functions: ``reward.fn: package.module:function`` instead of math-verify.

The function is called as ``fn(prompt, completion, row)``: ``prompt`` is the row's question
(the user message before any template), ``completion`` the decoded response, ``row`` a dict
of the row (``id``, ``question``, ``answer``, ``solution``, ``source``). It returns a float
(the reward; the sample counts as correct when it reaches ``reward.correct``) or a grade
record, a dict ``{"reward": float, "correct": bool, "reason": str}`` (``correct`` and
``reason`` optional). It runs in the grading worker pool with the same deadlines as
math-verify (``reward.item_timeout_s``, ``reward.batch_deadline_s``): an exception, a
non-finite or non-numeric reward is a graded failure (reason ``crash``, reward
``reward.error``) and an overrun a ``timeout``; the run logs why and goes on.

The module must be importable by the workers (installed, or on ``PYTHONPATH``; not the
script that calls ``tppo_jax.fit``, which the workers never import).
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from typing import Any

from tppo_jax.config_checks import ConfigError

RewardFn = Callable[[str, str, dict], Any]


def load_reward_fn(path: str) -> RewardFn:
    """The callable ``package.module:function`` names; ``ConfigError`` (one line) when it
    cannot be imported or is not callable."""
    module, sep, name = path.partition(":")
    if not sep or not module or not name:
        raise ConfigError(f"reward.fn: expected package.module:function, got {path!r}")
    try:
        fn = importlib.import_module(module)
        for part in name.split("."):
            fn = getattr(fn, part)
    except Exception as e:  # noqa: BLE001 -- any import-time error is the user's to fix
        raise ConfigError(f"reward.fn: cannot import {path}: {type(e).__name__}: {e}") from None
    if not callable(fn):
        raise ConfigError(f"reward.fn: {path} is not callable")
    return fn


def call_reward_fn(fn: RewardFn, prompt: str, completion: str, row: dict,
                   correct_reward: float) -> tuple[str, float | None, str | None]:
    """``(reason, reward, note)`` of one call: ``ok`` / ``wrong`` with the reward, or
    ``crash`` with no reward and a note that says why (never raises)."""
    try:
        out = fn(prompt, completion, row)
    except Exception as e:  # noqa: BLE001 -- a failing reward is a graded failure
        return "crash", None, f"raised {type(e).__name__}: {str(e)[:200]}"
    correct, reason = None, None
    if isinstance(out, dict):
        correct, reason, out = out.get("correct"), out.get("reason"), out.get("reward")
    if isinstance(out, bool) or not isinstance(out, (int, float)):
        return "crash", None, f"returned {type(out).__name__}, not a number"
    value = float(out)
    if not math.isfinite(value):
        return "crash", None, f"returned {value}"
    ok = bool(correct) if correct is not None else value >= correct_reward
    note = str(reason)[:200] if reason is not None else None
    return ("ok" if ok else "wrong"), value, note
