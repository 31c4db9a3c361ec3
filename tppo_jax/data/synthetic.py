"""The embedded default task: seeded, sympy-checked multi-step arithmetic word problems.

Sized for a tiny policy (~1M params, 128-piece vocab with split digits, 128-256 token context):
every problem is a chain of small steps over 1-2 digit numbers, e.g.

    Q: Tom has 12 apples. He gets 7 more, then gives away 5, then gets 9. How many apples now?
    A: 12 + 7 = 19
    19 - 5 = 14
    14 + 9 = 23
    \\boxed{23}

The number of steps is ``1 + Geometric(p)`` (capped at ``max_steps``) with ``p = 1/(1+difficulty)``,
so response lengths are long-tailed: most are short, a few are several times the median -- the
regime in which truncated rollouts pay off.

``style="daily"`` asks for one operation repeated over ``n`` days (``n`` drawn as above), so a
short question asks for a long worked solution -- the shape of a reasoning trace:

    Q: Ann has 40 cards. Each day she gives away 3. How many cards after 4 days?
    A: day 1 of 4: 40 - 3 = 37
    day 2 of 4: 37 - 3 = 34
    day 3 of 4: 34 - 3 = 31
    day 4 of 4: 31 - 3 = 28
    \\boxed{28}

The operand shrinks as ``n`` grows so every value stays in ``[0, max_value]``.

``teacher_corpus`` produces warm-start texts with a *known* fraction of wrong intermediate steps
(propagated to the final answer) and of missing ``\\boxed{}`` formats, so the warm-started policy
makes mistakes that RL can fix.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import sympy

from tppo_jax.data.prompts import short_prompt
from tppo_jax.data.readers import MathExample

NAMES = ("Tom", "Ann", "Bob", "Mia", "Sam", "Eva", "Max", "Zoe", "Leo", "Ivy")
ITEMS = ("apples", "pens", "cards", "coins", "books", "eggs", "cups", "toys", "stamps", "shells")
_OPS = ("+", "-", "*", "/")
Split = str  # "train" | "test"


@dataclass(frozen=True)
class Problem:
    """A generated problem: the start value and the chain of ``(op, operand)`` steps."""

    name: str
    item: str
    start: int
    steps: tuple[tuple[str, int], ...]
    daily: bool = False  # one step repeated once per day (``style="daily"``)

    def question(self) -> str:
        """The word problem text."""
        if self.daily:
            op, x = self.steps[0]
            return (f"{self.name} has {self.start} {self.item}. Each day "
                    f"{_pronoun(self.name).lower()} {_phrase(op, x)}. How many {self.item} "
                    f"after {len(self.steps)} days?")
        phrases = [_phrase(op, x) for op, x in self.steps]
        body = ", then ".join(phrases)
        return (f"{self.name} has {self.start} {self.item}. {_pronoun(self.name)} {body}. "
                f"How many {self.item} now?")


@dataclass(frozen=True)
class TeacherRecord:
    """A warm-start text plus the noise applied to it (for tests and corpus statistics)."""

    example: MathExample
    text: str  # prompt + solution
    wrong_step: int | None  # index of the corrupted step, None when correct
    formatted: bool  # False when the final \boxed{} was dropped
    final: str  # the final answer written in the text (wrong when wrong_step is set)


def _pronoun(name: str) -> str:
    return "She" if name in ("Ann", "Mia", "Eva", "Zoe", "Ivy") else "He"


def _phrase(op: str, x: int) -> str:
    # One fixed phrase per op keeps the vocabulary tiny; the numbers carry the difficulty.
    if op == "+":
        return f"gets {x} more"
    if op == "-":
        return f"gives away {x}"
    if op == "*":
        return {2: "doubles them", 3: "triples them"}.get(x, f"multiplies them by {x}")
    return f"keeps 1/{x} of them"


def apply_op(value: sympy.Rational, op: str, x: int) -> sympy.Rational:
    """Exact (sympy) result of one step."""
    X = sympy.Integer(x)
    if op == "+":
        return value + X
    if op == "-":
        return value - X
    if op == "*":
        return value * X
    return sympy.Rational(value, X)


def _fmt(v: sympy.Rational) -> str:
    return str(v) if v.is_Integer else f"\\frac{{{v.p}}}{{{v.q}}}"


def _stable_hash(text: str) -> int:
    # Python's hash() is salted per process; splits must be identical across runs and hosts.
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


class SyntheticMathTask:
    """Seeded generator of step-by-step arithmetic problems with exact answers.

    Args:
      seed: base seed; ``sample``/``teacher_corpus`` are pure functions of (seed, split, n, ...).
      difficulty: mean number of *extra* steps beyond the first (``p = 1/(1+difficulty)``).
      max_steps: hard cap on steps (bounds the longest response).
      max_operand: largest added/subtracted number (1-2 digits).
      max_value: intermediate values stay in ``[0, max_value]``.
      test_fraction: share of the problem space (by question hash) reserved for ``split="test"``.
      style: ``"chain"`` (a different step per line, all named in the question) or
        ``"daily"`` (one step repeated per day: short question, long solution).
    """

    def __init__(
        self,
        seed: int = 0,
        difficulty: float = 1.5,
        *,
        max_steps: int = 12,
        max_operand: int = 20,
        max_value: int = 99,
        test_fraction: float = 0.1,
        style: str = "chain",
    ) -> None:
        if difficulty < 0:
            raise ValueError("difficulty must be >= 0")
        if style not in ("chain", "daily"):
            raise ValueError(f"style must be 'chain' or 'daily', got {style!r}")
        if max_steps < 1 or (style == "daily" and max_value < max_steps + 2):
            raise ValueError(f"need 1 <= max_steps and, for daily problems, max_value >= "
                             f"max_steps + 2 (got max_steps={max_steps}, max_value={max_value})")
        if not 0.0 < test_fraction < 1.0:
            raise ValueError("test_fraction must be in (0, 1)")
        self.seed = seed
        self.difficulty = difficulty
        self.max_steps = max_steps
        self.max_operand = max_operand
        self.max_value = max_value
        self.test_fraction = test_fraction
        self.style = style

    # ----------------------------------------------------------------------------- generation
    def _rng(self, split: Split, stream: str) -> random.Random:
        return random.Random(f"{self.seed}/{split}/{stream}")

    def _num_steps(self, rng: random.Random) -> int:
        p = 1.0 / (1.0 + self.difficulty)
        n = 1
        while n < self.max_steps and rng.random() > p:
            n += 1
        return n

    def _step(self, rng: random.Random, v: int) -> tuple[str, int]:
        """Pick a step keeping values in [0, max_value] and integral (tiny models, exact lines)."""
        choices: list[tuple[str, int]] = []
        if v + 1 <= self.max_value:
            choices.append(("+", rng.randint(1, min(self.max_operand, self.max_value - v))))
        if v >= 2:
            choices.append(("-", rng.randint(1, min(self.max_operand, v - 1))))
        muls = [k for k in (2, 3) if v >= 2 and v * k <= self.max_value]
        if muls:
            choices.append(("*", rng.choice(muls)))
        divs = [k for k in (2, 3, 4, 5) if v % k == 0 and v // k >= 2]
        if divs:
            choices.append(("/", rng.choice(divs)))
        # Weight +/- higher so most lines are the easiest kind.
        weights = [3 if op in "+-" else 1 for op, _ in choices]
        return rng.choices(choices, weights=weights)[0]

    def _daily_problem(self, rng: random.Random) -> Problem:
        """One step repeated for ``n`` days, values kept in ``[0, max_value]``."""
        n = self._num_steps(rng)
        x = rng.randint(1, max(1, min(self.max_operand, (self.max_value - 2) // n)))
        if rng.random() < 0.5:
            op, start = "+", rng.randint(2, self.max_value - n * x)
        else:
            op, start = "-", rng.randint(max(n * x, 2), self.max_value)
        return Problem(rng.choice(NAMES), rng.choice(ITEMS), start, ((op, x),) * n, daily=True)

    def _problem(self, rng: random.Random) -> Problem:
        if self.style == "daily":
            return self._daily_problem(rng)
        start = rng.randint(2, min(30, self.max_value))
        steps = []
        v = start
        for _ in range(self._num_steps(rng)):
            op, x = self._step(rng, v)
            steps.append((op, x))
            v = int(apply_op(sympy.Integer(v), op, x))
        return Problem(rng.choice(NAMES), rng.choice(ITEMS), start, tuple(steps))

    def split_of(self, question: str) -> Split:
        """Which split a question belongs to (by stable hash, so splits are disjoint)."""
        bucket = _stable_hash(question) % 10_000
        return "test" if bucket < self.test_fraction * 10_000 else "train"

    def problems(self, n: int, split: Split = "train") -> list[Problem]:
        """The first ``n`` problems of ``split`` (rejection-sampled by question hash)."""
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        rng = self._rng(split, "problems")
        out: list[Problem] = []
        while len(out) < n:
            prob = self._problem(rng)
            if self.split_of(prob.question()) == split:
                out.append(prob)
        return out

    def solve(
        self, prob: Problem, wrong_step: int | None = None, delta: int = 0
    ) -> tuple[list[str], sympy.Rational]:
        """Worked lines and the final value; ``wrong_step`` adds ``delta`` to that step's result
        and the error propagates through the remaining (otherwise correct) lines."""
        v = sympy.Integer(prob.start)
        lines = []
        for i, (op, x) in enumerate(prob.steps):
            r = apply_op(v, op, x)
            if i == wrong_step:
                r = r + delta
            # "of n" on every line: a small model copies it from the line above and stops
            # when the two numbers match, instead of counting lines back to the question.
            day = f"day {i + 1} of {len(prob.steps)}: " if prob.daily else ""
            lines.append(f"{day}{_fmt(v)} {op} {x} = {_fmt(r)}")
            v = r
        return lines, v

    def to_example(self, prob: Problem, split: Split = "train") -> MathExample:
        """Package a problem as a MathExample (exact sympy answer, clean worked solution)."""
        lines, v = self.solve(prob)
        q = prob.question()
        return MathExample(
            id=f"syn-{split}-{_stable_hash(q):016x}",
            question=q,
            answer=_fmt(v),
            solution="\n".join([*lines, f"\\boxed{{{_fmt(v)}}}"]),
            source=f"synthetic(seed={self.seed},difficulty={self.difficulty},style={self.style})",
        )

    def sample(self, n: int, split: Split = "train") -> list[MathExample]:
        """``n`` examples of ``split``; deterministic in (seed, split) and prefix-stable in n."""
        return [self.to_example(p, split) for p in self.problems(n, split)]

    @staticmethod
    def prompt(example: MathExample) -> str:
        """The short prompt format the tiny model is trained and sampled with."""
        return short_prompt(example.question)

    # ------------------------------------------------------------------------- teacher corpus
    def _wrong_delta(self, prob: Problem, step: int, rng: random.Random) -> int:
        """A nonzero error for ``step`` that keeps later divisions exact and values >= 0."""
        # Later divisions scale the error by 1/k: a multiple of their product stays integral.
        div = 1
        for op, x in prob.steps[step + 1 :]:
            if op == "/":
                div *= x
        m = rng.randint(1, 3)
        for sign in (rng.choice((-1, 1)), 1):
            delta = sign * m * div
            v = sympy.Integer(prob.start)
            ok = True
            for i, (op, x) in enumerate(prob.steps):
                v = apply_op(v, op, x) + (delta if i == step else 0)
                ok = ok and v >= 0
            if ok:
                return delta
        return m * div  # unreachable: a positive error never makes values negative

    def teacher_records(
        self,
        n: int,
        wrong_step_frac: float = 0.2,
        no_format_frac: float = 0.1,
        split: Split = "train",
    ) -> list[TeacherRecord]:
        """``n`` warm-start records with exactly ``round(n*frac)`` wrong / unformatted ones."""
        for name, frac in (("wrong_step_frac", wrong_step_frac), ("no_format_frac",
                                                                    no_format_frac)):
            if not 0.0 <= frac <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {frac}")
        probs = self.problems(n, split)
        rng = self._rng(split, f"teacher/{wrong_step_frac}/{no_format_frac}")
        # Exact counts (not Bernoulli draws) so the noise level is known, not just expected.
        wrong = set(rng.sample(range(n), round(n * wrong_step_frac)))
        unformatted = set(rng.sample(range(n), round(n * no_format_frac)))
        out = []
        for i, prob in enumerate(probs):
            ex = self.to_example(prob, split)
            step = delta = None
            if i in wrong:
                step = rng.randrange(len(prob.steps))
                delta = self._wrong_delta(prob, step, rng)
            lines, v = self.solve(prob, step, delta or 0)
            final = _fmt(v)
            # Unformatted answers still state the number, just not in the graded format.
            last = f"\\boxed{{{final}}}" if i not in unformatted else f"The answer is {final}."
            text = self.prompt(ex) + "\n".join([*lines, last])
            out.append(TeacherRecord(ex, text, step, i not in unformatted, final))
        return out

    def teacher_corpus(
        self,
        n: int,
        wrong_step_frac: float = 0.2,
        no_format_frac: float = 0.1,
        split: Split = "train",
    ) -> list[str]:
        """Prompt+solution texts for the supervised warm-start (see ``teacher_records``)."""
        return [r.text for r in self.teacher_records(n, wrong_step_frac, no_format_frac, split)]


# ------------------------------------------------------------------------------- statistics
def _percentile(sorted_vals: Sequence[int], q: float) -> float:
    if not sorted_vals:
        return 0.0
    k = (len(sorted_vals) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(sorted_vals) - 1)
    return sorted_vals[lo] + (sorted_vals[hi] - sorted_vals[lo]) * (k - lo)


def length_stats(lengths: Sequence[int]) -> dict[str, float]:
    """min / median / mean / p90 / max and max-to-median ratio of a list of lengths."""
    s = sorted(int(x) for x in lengths)
    if not s:
        return {"n": 0}
    med = _percentile(s, 0.5)
    return {
        "n": len(s), "min": s[0], "median": med, "mean": sum(s) / len(s),
        "p90": _percentile(s, 0.9), "max": s[-1], "max_over_median": s[-1] / max(med, 1e-9),
    }


def length_histogram(
    values: Sequence[int] | Sequence[str],
    *,
    bins: int = 10,
    width: int = 40,
    length_fn: Callable[[str], int] = len,
    unit: str = "chars",
) -> str:
    """Text histogram of lengths (ints, or strings measured with ``length_fn``) + summary line."""
    lengths = [length_fn(v) if isinstance(v, str) else int(v) for v in values]
    if not lengths:
        return "(no data)"
    st = length_stats(lengths)
    lo, hi = min(lengths), max(lengths)
    step = max(1, -(-(hi - lo + 1) // bins))  # ceil: every value lands in a bin
    counts = [0] * bins
    for x in lengths:
        counts[min((x - lo) // step, bins - 1)] += 1
    peak = max(counts)
    rows = []
    for b, c in enumerate(counts):
        a = lo + b * step
        if a > hi:
            break
        bar = "#" * (round(width * c / peak) if c else 0)
        rows.append(f"{a:>6}-{a + step - 1:<6} {c:>6} {bar}")
    rows.append(
        f"n={st['n']} {unit}: min={st['min']} median={st['median']:.0f} mean={st['mean']:.1f} "
        f"p90={st['p90']:.0f} max={st['max']} (max/median={st['max_over_median']:.1f})"
    )
    return "\n".join(rows)
