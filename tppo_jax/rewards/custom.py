"""User reward functions: ``reward.fn: package.module:function`` instead of math-verify.

The function is called as ``fn(prompt, completion, row)``: ``prompt`` is the row's question
(the user message before any template), ``completion`` the decoded response, ``row`` a dict
of the row (``id``, ``question``, ``answer``, ``solution``, ``source``). It returns a number
(a numpy scalar too; the sample counts as correct when it reaches ``reward.correct``) or a
grade record, a dict ``{"reward": float, "correct": bool, "reason": str}`` (``correct`` and
``reason`` optional; the reason is kept in ``samples.jsonl``). It runs in the grading worker
pool with the same deadlines as math-verify (``reward.item_timeout_s``,
``reward.batch_deadline_s``): an exception, a non-numeric reward, one beyond
``reward.max_abs`` (float32's losses overflow past it) or a non-bool ``correct`` is a graded
failure (reason ``crash``, reward ``reward.error``) and an overrun a ``timeout``; the run
logs why and goes on, unless it fails on nearly every item of a batch (``STOP_FRACTION``):
then it stops in one line (``RewardFnError``).

The module is found as Python finds a script's (installed, on ``PYTHONPATH``, or in the
working directory: ``tppo_jax/plugins.py``, the one rule for every function a config names);
not the script that calls ``tppo_jax.fit``, which the workers never
import. ``check_reward_fn`` imports it and calls it once on a sample row in a child process
before a run starts (``tppo config``, and ``tppo train`` before the warm-start), so a
module that is missing, raises, or ends the process at import is one line up front.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from tppo_jax.config_checks import ConfigError
from tppo_jax.plugins import load_plugin

RewardFn = Callable[[str, str, dict], Any]


class RewardFnError(ConfigError):
    """The reward function fails on (nearly) every item of a grading batch; one line."""


# A grading batch whose reward.fn failed (raised, or returned no usable number) on at least
# this fraction of its items, and on at least MIN_FAILED of them, stops the run: every
# reward the run would learn from is ``reward.error``.
STOP_FRACTION = 0.9
MIN_FAILED = 4
# What a sample-row check allows the import and one call (a module may load a model).
CHECK_TIMEOUT_S = 300


def load_reward_fn(path: str, cwd: str | None = None) -> RewardFn:
    """The callable ``package.module:function`` names (a module in ``cwd``, default the
    working directory, too: ``plugins.load_plugin``, the rule ``algo.advantage_baseline``
    follows too); ``ConfigError`` (one line) when it cannot be imported or is not callable."""
    return load_plugin("reward.fn", path, cwd)


def _real(value: Any) -> bool:
    """A number a reward can be: int, float or a numpy scalar of either (not a bool)."""
    import numpy as np

    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def call_reward_fn(fn: RewardFn, prompt: str, completion: str, row: dict,
                   correct_reward: float, max_abs: float = math.inf
                   ) -> tuple[str, float | None, str | None]:
    """``(reason, reward, note)`` of one call: ``ok`` / ``wrong`` with the reward, or
    ``crash`` with no reward and a note that says why (never raises). A reward must be a
    real number (numpy scalars too) within ``max_abs`` (``reward.max_abs``: larger ones
    overflow float32 or the losses); ``correct``, when given, true or false."""
    import numpy as np

    try:
        out = fn(prompt, completion, row)
    except Exception as e:  # noqa: BLE001 -- a failing reward is a graded failure
        return "crash", None, f"raised {type(e).__name__}: {str(e)[:200]}"
    correct, reason = None, None
    if isinstance(out, dict):
        correct, reason, out = out.get("correct"), out.get("reason"), out.get("reward")
    if not _real(out):
        return "crash", None, f"returned {type(out).__name__}, not a number"
    if correct is not None and not isinstance(correct, (bool, np.bool_)):
        return "crash", None, (f"returned correct={str(correct)[:40]!r} "
                               f"({type(correct).__name__}), not true/false")
    value = float(out)
    if not math.isfinite(value) or abs(value) > max_abs:
        return "crash", None, f"returned {value:g}, beyond reward.max_abs={max_abs:g}"
    ok = bool(correct) if correct is not None else value >= correct_reward
    note = str(reason)[:200] if reason is not None else None
    return ("ok" if ok else "wrong"), value, note


# The child of ``check_reward_fn``: import, call once, print the outcome as one JSON line.
# This file is loaded by its path: the rewards package would import math-verify and sympy.
_CHECK = """
import importlib.util, json, sys
from tppo_jax.config_checks import ConfigError
here, path, row, correct, max_abs = json.loads(sys.argv[1])
spec = importlib.util.spec_from_file_location("_tppo_reward_check", here)
custom = importlib.util.module_from_spec(spec)
spec.loader.exec_module(custom)
try:
    fn = custom.load_reward_fn(path)
except ConfigError as e:
    print("TPPO-CHECK " + json.dumps(["import", str(e)]), flush=True)
    sys.exit(0)
completion = "The answer is \\boxed{" + str(row["answer"]) + "}."
out = custom.call_reward_fn(fn, str(row.get("question", "")), completion, row, correct,
                           max_abs)
print("TPPO-CHECK " + json.dumps(["call", out]), flush=True)
"""


def check_reward_fn(path: str | None, row: dict, *, correct_reward: float = 1.0,
                    max_abs: float = math.inf) -> tuple[str, float | None, str | None] | None:
    """Imports ``reward.fn`` and calls it once on ``row`` with a correct boxed answer, in a
    child process (an ``os._exit`` or a crash at import cannot end the caller). Returns the
    call's ``(reason, reward, note)`` (None without ``path``); ``ConfigError`` in one line
    naming the module and the fix when it cannot be imported, raises, returns no usable
    reward, or ends the process."""
    if not path:
        return None
    import tppo_jax

    root = os.path.dirname(os.path.dirname(os.path.abspath(tppo_jax.__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [root, *filter(None, [os.environ.get("PYTHONPATH")])])}
    arg = json.dumps([os.path.abspath(__file__), path, row, correct_reward,
                      max_abs if math.isfinite(max_abs) else 1e308])
    try:
        r = subprocess.run([sys.executable, "-c", _CHECK, arg], capture_output=True,
                           text=True, timeout=CHECK_TIMEOUT_S, env=env, check=False)
    except subprocess.TimeoutExpired:
        raise ConfigError(f"reward.fn: importing {path} and calling it once took over "
                          f"{CHECK_TIMEOUT_S} s; make its import and one call faster") from None
    line = next((x for x in r.stdout.splitlines() if x.startswith("TPPO-CHECK ")), None)
    if line is None:
        last = (r.stderr.strip().splitlines() or [""])[-1][:200]
        raise ConfigError(f"reward.fn: importing {path} or calling it ended the process "
                          f"(exit code {r.returncode}{': ' + last if last else ''}); a reward "
                          f"module must not exit or crash the interpreter")
    kind, out = json.loads(line.removeprefix("TPPO-CHECK "))
    if kind == "import":
        raise ConfigError(out)
    reason, value, note = out
    if reason == "crash":
        raise ConfigError(f"reward.fn: {path} failed on a sample row (id {row.get('id')!r}, "
                          f"answer {str(row.get('answer'))[:40]!r}): it {note}; fix the "
                          f"function (it is called as fn(prompt, completion, row))")
    return reason, value, note


# The row ``tppo config`` checks a reward function on (``tppo train`` uses the data's first).
SAMPLE_ROW = {"id": "sample", "question": "What is 1 + 1?", "answer": "2", "solution": None,
              "source": "sample"}


def check_reward(reward: Any, rows: Any = ()) -> None:
    """``check_reward_fn`` for a config's ``reward`` section, on the first of ``rows``
    (``MathExample``; ``SAMPLE_ROW`` when none): ``ConfigError`` in one line when it fails,
    a warning when the row's own answer, boxed, does not count as correct."""
    import dataclasses
    import logging

    if not reward.fn:
        return
    row = dataclasses.asdict(rows[0]) if len(rows) else SAMPLE_ROW
    reason, value, _ = check_reward_fn(reward.fn, row, correct_reward=reward.correct,
                                       max_abs=reward.max_abs)
    if reason != "ok":
        logging.getLogger(__name__).warning(
            "reward.fn %s gives %g to a sample row's own answer boxed (\\boxed{%s}), not "
            "counted correct: does it read \\boxed{} answers?", reward.fn, value,
            str(row["answer"])[:40])
