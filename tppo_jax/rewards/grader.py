"""Outcome rewards: math-verify grading (``grading.py``) in a pool of worker processes that
owns the deadline.

Why a hand-rolled pool instead of ``ProcessPoolExecutor``: math-verify's own timeout is
``signal.alarm`` (whole seconds, main thread only, and it cannot interrupt a long C call such as a
huge integer power), so the parent must be able to kill *one* stuck worker. An executor neither
tells when a queued task actually started (so per-item timeouts are unknowable) nor survives a
killed worker (``BrokenProcessPool``). Here every worker has its own pipe; the parent dispatches
one item at a time, times it, and kills + replaces a worker that overruns ``item_timeout_s``.
Whatever is unfinished at ``batch_deadline_s`` scores as a timeout, so a batch never hangs.

Reasons per item: ``ok`` (correct), ``wrong``, ``no_answer`` (no ``\\boxed{}`` / unparsable),
``timeout``, ``crash`` (worker died or grading raised). With ``reward_fn`` (``reward.fn``) the
workers call the user's function instead of math-verify (``rewards/custom.py``), with the same
deadlines.
"""

from __future__ import annotations

import contextlib
import logging
import math
import multiprocessing as mp
import os
import signal
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any

import numpy as np

from tppo_jax.config_checks import ConfigError
from tppo_jax.data.answers import answer_problem, parse_gold
from tppo_jax.rewards.custom import MIN_FAILED, STOP_FRACTION, RewardFnError, load_reward_fn
from tppo_jax.rewards.grading import (
    ANSWER_FORMATS,
    DEFAULT_ANSWER_FORMATS,
    REASONS,
    answer_format_for,
    extract_answer,
    grade_item,
    grade_one,
)
from tppo_jax.rewards.workers import start_worker

# Re-exported: callers import one answer's grading from here with the pool.
__all__ = ["ANSWER_FORMATS", "DEFAULT_ANSWER_FORMATS", "REASONS", "GradeResult", "MathGrader",
           "answer_format_for", "answer_problem", "extract_answer", "grade_item", "grade_one",
           "overlong_penalty", "parse_gold"]

if TYPE_CHECKING:
    from tppo_jax.config import RewardConfig

logger = logging.getLogger(__name__)

def _worker_main(conn: Connection, grade_kw: dict[str, Any], fn_path: str | None = None,
                 correct_reward: float = 1.0, max_abs: float = math.inf,
                 cwd: str | None = None) -> None:
    """Worker loop: pre-warm, then answer ``(idx, completion, answer, row)`` with
    ``(idx, reason, reward, note)`` until ``None``/EOF. A reward function that cannot be
    imported here is reported once (``("failed", message)``), not as a traceback."""
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # timeouts are counted, not logged
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle (close())
    try:
        fn = load_reward_fn(fn_path, cwd) if fn_path else None
    except ConfigError as e:
        with contextlib.suppress(OSError):
            conn.send(("failed", f"{e} (in a grading worker)"))
        return
    if fn is None:
        grade_one("\\boxed{1}", "1", **grade_kw)  # import + compile regexes now
    try:
        conn.send(("ready", os.getpid()))
    except OSError:  # the parent closed or replaced us while we were starting
        return
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        idx, completion, answer, row = msg
        try:
            out = grade_item(grade_kw, fn, correct_reward, completion, answer, row, max_abs)
        except Exception:  # noqa: BLE001 - a grading bug scores 0, it must not kill the worker
            out = ("crash", None, None)
        try:
            conn.send((idx, *out))
        except OSError:
            return


# ---------------------------------------------------------------------------------- the pool
def _context(name: str | None) -> Any:
    """The multiprocessing context for workers.

    forkserver is preferred: its server process imports math-verify once, so a replacement for
    a killed or recycled worker is a cheap fork (~tens of ms) instead of a ~1 s cold spawn that
    would stall the batch. The server is exec'd fresh, so it holds no JAX/thread state.
    """
    if name is None:
        name = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
    if name == "fork":
        raise ValueError("mp_context='fork' is unsafe with JAX threads; use forkserver or spawn")
    ctx = mp.get_context(name)
    if name == "forkserver":
        # Ignored if the forkserver already runs (then it was started by an earlier grader).
        ctx.set_forkserver_preload(["tppo_jax.rewards.grader", "math_verify"])
    return ctx


@dataclass
class _Worker:
    proc: Any  # multiprocessing.Process from the chosen context
    conn: Connection
    ready: bool = False
    task: int | None = None
    started: float = 0.0
    done: int = 0


@dataclass
class GradeResult:
    """Per-item outcome of :meth:`MathGrader.grade`."""

    rewards: np.ndarray  # [N] float32
    correct: np.ndarray  # [N] bool
    reasons: list[str]
    counts: dict[str, int] = field(default_factory=dict)
    elapsed_s: float = 0.0
    notes: list[str | None] = field(default_factory=list)  # reward.fn's reason, or its error


class MathGrader:
    """Grades completions with math-verify in ``num_workers`` processes.

    Args:
      num_workers: worker processes; 0 grades inline (no kill-based deadline; debugging only).
      item_timeout_s: wall-clock limit per item, measured from dispatch to a worker.
      batch_deadline_s: wall-clock limit per ``grade`` call.
      max_tasks_per_child: recycle a worker after this many items (bounds sympy cache growth).
      crash_retries: re-grade an item on a fresh worker this often if its worker dies (an OOM
        kill or a race with an unrelated death should not cost a sample its reward).
      correct_reward, wrong_reward: reward values (e.g. 1/0 or 1/-1).
      no_answer_reward: reward for a missing/unparsable answer (default: ``wrong_reward``).
      error_reward: reward for ``timeout``/``crash`` items (default: ``wrong_reward``; a
        grader failure must never beat a wrong answer, e.g. 0 against -1 rewards).
      require_boxed, accept_answer_line, answer_format: which answer text is graded (see
        :func:`grade_one` and ``ANSWER_FORMATS``).
      mv_timeout_s: math-verify's inner timeout in whole seconds (None: off).
      mp_context: ``"forkserver"`` (default where available) or ``"spawn"``; never ``fork``,
        the parent runs JAX threads.
      startup_timeout_s: how long the constructor waits for the pre-warmed workers.
      reward_fn: ``package.module:function`` called instead of math-verify
        (``rewards/custom.py``); imported here first, so a bad path fails in one line.
      max_abs: a ``reward_fn`` result beyond +-this is a graded failure (``crash``).
    """

    def __init__(
        self,
        num_workers: int = 2,
        item_timeout_s: float = 2.0,
        batch_deadline_s: float = 30.0,
        max_tasks_per_child: int = 500,
        *,
        correct_reward: float = 1.0,
        wrong_reward: float = 0.0,
        no_answer_reward: float | None = None,
        error_reward: float | None = None,
        require_boxed: bool = True,
        accept_answer_line: bool = False,
        answer_format: str | None = None,
        mv_timeout_s: int | None = 1,
        mp_context: str | None = None,
        startup_timeout_s: float = 60.0,
        crash_retries: int = 1,
        reward_fn: str | None = None,
        max_abs: float = math.inf,
    ) -> None:
        if num_workers < 0 or item_timeout_s <= 0 or batch_deadline_s <= 0:
            raise ValueError("num_workers >= 0 and positive timeouts required")
        if max_tasks_per_child < 1:
            raise ValueError("max_tasks_per_child must be >= 1")
        self.num_workers = num_workers
        self.item_timeout_s = item_timeout_s
        self.batch_deadline_s = batch_deadline_s
        self.max_tasks_per_child = max_tasks_per_child
        self.reward_of = {
            "ok": correct_reward,
            "wrong": wrong_reward,
            "no_answer": wrong_reward if no_answer_reward is None else no_answer_reward,
            "timeout": wrong_reward if error_reward is None else error_reward,
            "crash": wrong_reward if error_reward is None else error_reward,
        }
        self.grade_kw: dict[str, Any] = {
            "require_boxed": require_boxed,
            "accept_answer_line": accept_answer_line,
            "answer_format": answer_format,
            "mv_timeout_s": mv_timeout_s,
        }
        self.reward_fn, self.max_abs, self._cwd = reward_fn, max_abs, os.getcwd()
        self._fn = load_reward_fn(reward_fn) if reward_fn else None  # ConfigError when bad
        self._ctx = _context(mp_context)
        self._startup_timeout_s = startup_timeout_s
        self.crash_retries = crash_retries
        # Lifetime counters, for logs and tests.
        self.stats = {"started": 0, "recycled": 0, "killed": 0, "died": 0}
        self._retired: list[Any] = []
        self._closed = False
        self._startup_failures = 0
        self._workers: list[_Worker] = [self._spawn() for _ in range(num_workers)]
        try:
            warm = not num_workers or self._wait_warm(startup_timeout_s, every=True)
        except BaseException:
            self.close()
            raise
        if not warm:
            self.close()
            raise TimeoutError("grading workers did not start in time")

    @classmethod
    def from_config(cls, reward: RewardConfig, data_format: str) -> MathGrader:
        """The outcome grader a run's ``reward`` section configures; the graded answer text
        follows ``data_format`` unless ``reward.answer_format`` names one."""
        kw = {} if reward.error is None else {"error_reward": reward.error}
        return cls(num_workers=reward.workers, item_timeout_s=reward.item_timeout_s,
                   batch_deadline_s=reward.batch_deadline_s,
                   max_tasks_per_child=reward.max_tasks_per_child,
                   correct_reward=reward.correct, wrong_reward=reward.wrong,
                   no_answer_reward=reward.no_answer, crash_retries=reward.crash_retries,
                   answer_format=answer_format_for(data_format, reward.answer_format),
                   mv_timeout_s=reward.verify_timeout_s, reward_fn=reward.fn,
                   max_abs=reward.max_abs, **kw)

    # -------------------------------------------------------------------- worker management
    def _spawn(self) -> _Worker:
        parent, child = self._ctx.Pipe(duplex=True)
        proc = self._ctx.Process(target=_worker_main, daemon=True, args=(
            child, self.grade_kw, self.reward_fn, self.reward_of["ok"], self.max_abs,
            self._cwd))
        start_worker(proc)  # never re-runs the user's script (rewards/workers.py)
        child.close()  # so the parent sees EOF when the worker dies
        self.stats["started"] += 1
        return _Worker(proc, parent)

    def _replace(self, i: int, why: str) -> None:
        """Retire worker ``i`` (``why``: ``killed`` | ``died`` | ``recycled``) and start another."""
        w = self._workers[i]
        self.stats[why] += 1
        if why != "recycled":
            w.proc.kill()  # a no-op on a dead process
        else:
            with contextlib.suppress(OSError):  # graceful: the worker exits after its loop
                w.conn.send(None)
        w.conn.close()
        self._retired.append(w.proc)
        for p in self._retired:  # reap exited ones without blocking
            p.join(timeout=0)
        self._retired = [p for p in self._retired if p.is_alive()]
        self._workers[i] = self._spawn()

    def _wait_warm(self, timeout_s: float, *, every: bool) -> bool:
        """Wait until every (or any) worker is warm; dead ones are replaced meanwhile."""
        end = time.monotonic() + timeout_s
        while not (all if every else any)(w.ready for w in self._workers):
            left = end - time.monotonic()
            if left <= 0:
                return False
            if self._startup_failures > 3 * self.num_workers:  # broken env: fail loudly
                if self.reward_fn:  # its import in a worker ends the process
                    raise ConfigError(f"reward.fn: grading workers importing {self.reward_fn} "
                                      f"keep dying during start-up; a reward module must not "
                                      f"exit or crash the interpreter")
                raise RuntimeError("grading workers keep dying during start-up")
            for conn in wait([w.conn for w in self._workers], timeout=left):
                self._on_message(conn, [], deque(), {})
        return True

    def worker_pids(self) -> list[int | None]:
        """PIDs of the current workers (for monitoring and tests)."""
        return [w.proc.pid for w in self._workers]

    # ------------------------------------------------------------------------------ grading
    def grade(self, completions: Sequence[str], answers: Sequence[str],
              rows: Sequence[Any] | None = None) -> GradeResult:
        """Grade ``completions[i]`` against ``answers[i]``; never exceeds the batch deadline
        by more than the time it takes to kill the stuck workers. ``rows``: the data rows
        (``MathExample``), which a ``reward_fn`` receives."""
        if len(completions) != len(answers):
            raise ValueError(f"{len(completions)} completions vs {len(answers)} answers")
        if self._closed:
            raise RuntimeError("MathGrader is closed")
        for i, w in enumerate(self._workers):  # replace workers that died while idle
            if w.task is None and not w.proc.is_alive():
                self._replace(i, "died")
        if self.num_workers and completions and not any(w.ready for w in self._workers):
            # Every worker is being replaced (e.g. after a deadline kill): start-up time is not
            # grading time, so wait for one warm worker before the batch clock starts.
            self._wait_warm(self._startup_timeout_s, every=False)
        t0 = time.monotonic()
        row_dicts = ([_row_dict(r) for r in rows] if rows is not None and self.reward_fn
                     else [None] * len(answers))
        self._values: dict[int, tuple[float | None, str | None]] = {}
        if self.num_workers == 0:
            reasons = [self._grade_inline(i, c, a, r) for i, (c, a, r) in
                       enumerate(zip(completions, answers, row_dicts, strict=True))]
        else:
            reasons = self._grade_pool(list(completions), list(answers), row_dicts, t0)
        return self._result(reasons, time.monotonic() - t0)

    def _grade_inline(self, i: int, completion: str, answer: str, row: dict | None) -> str:
        try:
            reason, value, note = grade_item(self.grade_kw, self._fn, self.reward_of["ok"],
                                              completion, answer, row, self.max_abs)
        except Exception:  # noqa: BLE001
            logger.exception("grading failed")
            return "crash"
        self._values[i] = (value, note)
        return reason

    def _grade_pool(self, completions: list[str], answers: list[str], rows: list,
                    t0: float) -> list[str]:
        n = len(completions)
        reasons: list[str | None] = [None] * n
        pending = deque(range(n))
        crashes: dict[int, int] = {}
        deadline = t0 + self.batch_deadline_s
        while pending or any(w.task is not None for w in self._workers):
            now = time.monotonic()
            for w in self._workers:  # dispatch to idle, warm workers
                if w.ready and w.task is None and pending:
                    idx = pending.popleft()
                    try:
                        w.conn.send((idx, completions[idx], answers[idx], rows[idx]))
                        w.task, w.started = idx, now
                    except OSError:  # died while idle: retried on a fresh worker
                        pending.appendleft(idx)
                        w.ready = False
            busy = [w.started + self.item_timeout_s for w in self._workers if w.task is not None]
            wake = min([deadline, *busy])
            # A dead worker's pipe reads EOF, so deaths (busy, idle or starting) land here too.
            conns = [w.conn for w in self._workers]
            for conn in wait(conns, timeout=max(0.0, wake - time.monotonic())):
                self._on_message(conn, reasons, pending, crashes)
            now = time.monotonic()
            for i, w in enumerate(self._workers):
                if w.task is not None and now - w.started > self.item_timeout_s:
                    reasons[w.task] = "timeout"
                    self._replace(i, "killed")
            if now >= deadline:
                for i, w in enumerate(self._workers):
                    if w.task is not None:
                        reasons[w.task] = "timeout"
                        self._replace(i, "killed")
                for idx in pending:
                    reasons[idx] = "timeout"
                break
        return [r if r is not None else "timeout" for r in reasons]

    def _on_message(
        self, conn: Connection, reasons: list[str | None], pending: deque, crashes: dict[int, int]
    ) -> None:
        i = next(k for k, w in enumerate(self._workers) if w.conn is conn)
        w = self._workers[i]
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # the worker process died (segfault, OOM kill, ...)
            if w.task is not None:
                crashes[w.task] = crashes.get(w.task, 0) + 1
                if crashes[w.task] > self.crash_retries:
                    reasons[w.task] = "crash"
                else:
                    pending.appendleft(w.task)
            self._startup_failures += not w.ready
            self._replace(i, "died")
            return
        if msg[0] == "ready":
            w.ready = True
            return
        if msg[0] == "failed":  # the reward function cannot be imported there: one line
            raise ConfigError(msg[1])
        idx, reason, value, note = msg
        if idx == w.task:
            reasons[idx] = reason
            self._values[idx] = (value, note)
        w.task = None
        w.done += 1
        if w.done >= self.max_tasks_per_child:
            self._replace(i, "recycled")

    def _result(self, reasons: list[str], elapsed: float) -> GradeResult:
        counts = dict.fromkeys(REASONS, 0)
        for r in reasons:
            counts[r] += 1
        values = getattr(self, "_values", {})
        rewards = np.array([self.reward_of[r] if values.get(i, (None,))[0] is None or
                            r in ("timeout", "crash") else values[i][0]
                            for i, r in enumerate(reasons)], dtype=np.float32)
        notes = [values.get(i, (None, None))[1] for i in range(len(reasons))]
        if self.reward_fn:
            self._check_failures(reasons, notes)
        correct = np.array([r == "ok" for r in reasons], dtype=bool)
        return GradeResult(rewards, correct, reasons, counts, elapsed, notes)

    def _check_failures(self, reasons: list[str], notes: list[str | None]) -> None:
        """Logs a batch's reward-function failures; ``RewardFnError`` when it failed (a
        ``crash``: raised, or no usable reward) on ``STOP_FRACTION`` of the items and at
        least ``MIN_FAILED``: every reward would be ``reward.error``, a run learns nothing."""
        failed = [i for i, r in enumerate(reasons) if r in ("timeout", "crash")]
        if not failed:
            return
        crashed = [i for i in failed if reasons[i] == "crash"]
        i = (crashed or failed)[0]
        first = (f"it {notes[i]}" if notes[i] else
                 "its grading worker died" if reasons[i] == "crash" else "it timed out")
        if len(crashed) >= max(MIN_FAILED, STOP_FRACTION * len(reasons)):
            raise RewardFnError(
                f"reward.fn {self.reward_fn} failed on {len(crashed)} of {len(reasons)} items "
                f"of one grading batch (a run stops at {STOP_FRACTION:.0%}, at least "
                f"{MIN_FAILED}); first: {first}; fix the function, then run again "
                f"(--resume continues from the last checkpoint)")
        logger.warning("reward.fn %s: %d of %d items failed (scored %g); first: %s",
                       self.reward_fn, len(failed), len(reasons), self.reward_of["crash"],
                       first)

    # ---------------------------------------------------------------------------- lifecycle
    def close(self) -> None:
        """Stop all workers (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for w in self._workers:
            if w.ready:  # a warm worker exits on None; one still importing is just killed
                with contextlib.suppress(OSError):
                    w.conn.send(None)
            else:
                w.proc.kill()
            w.conn.close()
        for p in [w.proc for w in self._workers] + self._retired:
            p.join(timeout=1.0)
            if p.is_alive():
                p.kill()
                p.join(timeout=1.0)
        self._workers, self._retired = [], []

    def __enter__(self) -> MathGrader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown
            self.close()


def _row_dict(row: Any) -> dict | None:
    """A data row as the dict a reward function receives."""
    if row is None or isinstance(row, dict):
        return row
    import dataclasses

    return dataclasses.asdict(row) if dataclasses.is_dataclass(row) else {"row": str(row)}


def overlong_penalty(
    lengths: np.ndarray | Sequence[int], max_len: int, buffer_len: int, penalty: float = 1.0
) -> np.ndarray:
    """DAPO soft overlong punishment, added to the outcome reward.

    ``0`` for ``|y| <= max_len - buffer_len``; ``penalty * (max_len - buffer_len - |y|) /
    buffer_len`` (linear from 0 down to ``-penalty``) up to ``max_len``; ``-penalty`` beyond.
    """
    if buffer_len <= 0 or buffer_len > max_len:
        raise ValueError("need 0 < buffer_len <= max_len")
    y = np.asarray(lengths, dtype=np.float64)
    soft = max_len - buffer_len
    r = np.where(y <= soft, 0.0, (soft - y) / buffer_len)
    return (penalty * np.maximum(r, -1.0)).astype(np.float32)
