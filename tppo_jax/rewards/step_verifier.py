"""Step verifier: split a worked solution into steps and check their arithmetic claims with sympy.

``verify_solution(text)`` splits the text into steps (lines, then sentences), extracts the claims
of each step and checks them in order:

- equalities and chains: ``48 + 57 = 105``, ``12 / 4 = 3 = x``, ``\\frac{1}{2} = 0.5``,
  ``3 x 4 = 12``, GSM8K calculator annotations ``<<48/2=24>>``; ``\\approx`` / ``≈`` compare
  loosely (1 %);
- assignments ``x = 3`` bind a variable for later steps (``2x = 6`` is then checkable);
- running totals ("now has 23", "23 left", "a total of 23") and the final ``\\boxed{23}`` /
  ``#### 23`` are compared with the last result computed in the same or the previous step.

Numbers are exact rationals (``0.1`` is ``1/10``); a side written as a bare decimal literal is
accepted within one unit of its last written digit (``2/3 = 0.67`` and ``2/3 = 0.66`` both pass),
every other comparison within ``rel_tol``.

Verdicts: a step is ``invalid`` if any claim is false, ``valid`` if it has at least one true claim,
else ``uncheckable`` (prose, unknowns, unsupported notation). Anything ambiguous (a claim that may
be cut off by words, ``2\\frac{1}{2}``, a product of two bare numbers) is uncheckable rather than
invalid: a false "invalid" punishes a correct policy, a missed one only loses signal.

Parsing one side of a claim is :mod:`tppo_jax.rewards.expr_parser` (safe: it never ``eval``s
model output and refuses unbounded work). A per-solution ``timeout_s`` budget covers the whole
call (finding claims as well as checking them): once spent, the remaining claims are uncheckable
and the remaining steps are not searched for claims. Aligning step ends with tokens is
:func:`tppo_jax.rewards.process.step_token_ends`.
"""

from __future__ import annotations

import bisect
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Literal

import sympy

from tppo_jax.rewards.expr_parser import (
    SideInfo,
    Token,
    Uncheckable,
    check_finite,
    clean_text,
    is_math_token,
    parse_side,
    tokenize,
)

Verdict = Literal["valid", "invalid", "uncheckable"]
ClaimVerdict = Literal["valid", "invalid", "uncheckable", "assignment", "unchecked"]

APPROX_REL_TOL = 1e-2
# A step (one line or sentence) longer than this is prose or degenerate output, never one worked
# step: it is uncheckable without being tokenized, so one huge line cannot eat the budget.
MAX_STEP_CHARS = 20_000


class _OutOfTime(Exception):
    """The solution's budget ran out while claims were being found."""


def _check_deadline(deadline: float | None) -> None:
    if deadline is not None and time.monotonic() > deadline:
        raise _OutOfTime


# ---------------------------------------------------------------------------------- data types
@dataclass(frozen=True)
class Step:
    """One step: ``solution[start:end] == text`` (stripped of surrounding whitespace)."""

    index: int
    text: str
    start: int
    end: int


@dataclass(frozen=True)
class Claim:
    """One checkable statement inside a step.

    ``kind``: ``equation`` (``lhs = rhs``; a chain gives one claim per adjacent pair),
    ``running_total`` (``rhs`` restates the last result, ``lhs`` empty) or ``final``
    (``\\boxed{rhs}`` / ``#### rhs``). ``start``/``end`` are offsets in the step text.
    """

    kind: Literal["equation", "running_total", "final"]
    lhs: str
    rhs: str
    start: int
    end: int
    approx: bool = False
    verdict: ClaimVerdict = "unchecked"
    reason: str = ""

    @property
    def text(self) -> str:
        """Readable form of the claim."""
        if self.kind == "equation":
            return f"{self.lhs} {'≈' if self.approx else '='} {self.rhs}"
        return f"{self.kind}: {self.rhs}"


@dataclass(frozen=True)
class StepVerdict:
    """A checked step. ``char_end``: end offset (exclusive) of the step in the solution text."""

    text: str
    verdict: Verdict
    claims: list[Claim]
    char_end: int
    char_start: int = 0


@dataclass(frozen=True)
class StepReport:
    """The steps of one solution (those reached within the budget: see ``timed_out``).

    ``all_valid``: no invalid step *and* at least one valid one (a solution with nothing checkable
    is not "all valid"); ``first_invalid``: index into ``steps`` or None.
    """

    steps: list[StepVerdict]
    all_valid: bool
    first_invalid: int | None
    elapsed_s: float = 0.0
    timed_out: bool = False

    @property
    def num_valid(self) -> int:
        """Steps with verdict ``valid``."""
        return sum(s.verdict == "valid" for s in self.steps)

    @property
    def num_invalid(self) -> int:
        """Steps with verdict ``invalid``."""
        return sum(s.verdict == "invalid" for s in self.steps)

    @property
    def num_checkable(self) -> int:
        """Steps that are not ``uncheckable``."""
        return sum(s.verdict != "uncheckable" for s in self.steps)


# ---------------------------------------------------------------------------------- splitting
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\\$(])")


def iter_steps(solution: str) -> Iterator[Step]:
    """The steps of ``solution`` in order: non-empty lines, and lines split into sentences
    (". " before a capital letter); a generator, so a budget can stop before the end.

    A decimal point never splits (``3.5``: no space after the dot). Offsets index ``solution``.
    """
    n = 0
    pos = 0
    for line in solution.splitlines(keepends=True):
        bounds = [0, *(m.end() for m in _SENTENCE_END.finditer(line)), len(line)]
        for a, b in zip(bounds[:-1], bounds[1:], strict=True):
            piece = line[a:b]
            stripped = piece.strip()
            if stripped:
                start = pos + a + (len(piece) - len(piece.lstrip()))
                yield Step(n, stripped, start, start + len(stripped))
                n += 1
        pos += len(line)


# Words that continue an expression: a claim right after "of"/"times" lost its left operand.
_OPERATOR_WORDS = {"of", "times", "by", "plus", "minus", "over", "per", "divided", "multiplied",
                   "than", "less", "more", "into", "squared", "cubed", "percent", "half",
                   "twice", "thrice", "double", "triple", "sqrt", "root"}


# ------------------------------------------------------------------------------ claim finding
_NUM = r"-?\$?\s?(\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?)"
_NOT_EXPR = r"(?!\s*[-+*/^=(%]|\d|\.\d|\s*\\(?:cdot|times|div))"  # the number is not an operand
_RUNNING = [
    re.compile(r"\b(?:now|still|then)\s+(?:has|have|had|owns?|holds?|is|are|was|were|gets?)\s+"
               r"(?:only\s+|a\s+total\s+of\s+)?" + _NUM + _NOT_EXPR, re.I),
    re.compile(r"\b(?:has|have|had|is|are|was|were|leaves?|leaving|remains?)\s+(?:only\s+)?"
               + _NUM + _NOT_EXPR + r"\s+(?:[a-z]+\s+)?(?:left|remaining|in\s+total|altogether|"
               r"total|now)\b", re.I),
    re.compile(r"\b(?:a\s+)?(?:total|sum|result|answer)\s+(?:is|was|of|equals|=)\s+" + _NUM
               + _NOT_EXPR, re.I),
    re.compile(r"\bleaves?\s+(?:him|her|them|us|me|it|you)?\s*(?:with\s+)?" + _NUM + _NOT_EXPR,
               re.I),
]
_FINAL = [
    re.compile(r"\\boxed\s*\{\s*" + _NUM + r"\s*\}"),
    re.compile(r"^\s*####\s*" + _NUM + r"\s*$", re.M),
]


def _trim(toks: list[Token]) -> list[Token]:
    """Drop surrounding whitespace and a stray spaced single letter ("a 3 + 4", "= 7 a")."""
    def strip_ws(ts: list[Token]) -> list[Token]:
        while ts and ts[0].kind in ("ws", "dollar"):
            ts = ts[1:]
        while ts and ts[-1].kind in ("ws", "dollar"):
            ts = ts[:-1]
        return ts

    toks = strip_ws(toks)
    if len(toks) >= 3 and toks[0].kind == "word" and toks[1].kind == "ws" and (
            toks[2].kind == "num" or toks[2].text == "("):
        toks = strip_ws(toks[1:])
    if len(toks) >= 3 and toks[-1].kind == "word" and toks[-2].kind == "ws" and (
            toks[-3].kind == "num" or toks[-3].text == ")"):
        toks = strip_ws(toks[:-1])
    return toks


def _split_sides(run: list[Token]) -> tuple[list[list[Token]], list[str]]:
    """Split a run at top-level ``=`` / ``≈``; returns sides and the relation between each pair."""
    sides: list[list[Token]] = [[]]
    rels: list[str] = []
    depth = 0
    for t in run:
        if t.text in ("(", "[", "{"):
            depth += 1
        elif t.text in (")", "]", "}"):
            depth -= 1
        if t.text in ("=", "≈") and depth == 0:
            rels.append(t.text)
            sides.append([])
        else:
            sides[-1].append(t)
    return [_trim(s) for s in sides], rels


def _neighbour_word(toks: list[Token], i: int, step: int) -> str:
    j = i + step
    while 0 <= j < len(toks) and toks[j].kind == "ws":
        j += step
    return toks[j].text.lower() if 0 <= j < len(toks) and toks[j].kind == "word" else ""


def _in_spans(pos: int, starts: list[int], spans: list[tuple[int, int]]) -> bool:
    """Whether ``pos`` lies in one of ``spans`` (disjoint, sorted; ``starts`` their starts)."""
    k = bisect.bisect_right(starts, pos) - 1
    return k >= 0 and spans[k][0] <= pos < spans[k][1]


def extract_claims(step: Step | str, *, deadline: float | None = None) -> list[Claim]:
    """All claims of a step, in text order, unchecked (``verdict="unchecked"``).

    ``deadline`` (a ``time.monotonic()`` value): raises ``_OutOfTime`` once past it, checked
    between token runs and between pattern matches, so a long step cannot overrun the budget.
    """
    text = step.text if isinstance(step, Step) else step
    claims: list[Claim] = []
    clean = clean_text(text)
    toks = tokenize(clean)
    eq_spans: list[tuple[int, int]] = []
    i = 0
    while i < len(toks):
        if not is_math_token(toks[i]):
            i += 1
            continue
        _check_deadline(deadline)
        j = i
        while j < len(toks) and is_math_token(toks[j]):
            j += 1
        run = toks[i:j]
        if any(t.text in ("=", "≈") for t in run):
            sides, rels = _split_sides(run)
            first, last = 0, len(sides) - 1
            # A side whose neighbour word continues the expression ("half of 48 = 24") or that
            # starts/ends with a dangling operator was cut off: drop it, keep the rest of the chain.
            s0 = sides[0]
            if _neighbour_word(toks, i, -1) in _OPERATOR_WORDS or (
                    s0 and (s0[0].text in ("*", "/", "^", "+", "%", "!")
                            or (s0[0].text == "-" and i > 0 and _neighbour_word(toks, i, -1)))):
                first = 1
            sl = sides[-1]
            if _neighbour_word(toks, j - 1, 1) in _OPERATOR_WORDS or (
                    sl and sl[-1].text in ("*", "/", "^", "+", "-")):
                last -= 1
            for k in range(first, last):
                if k % 256 == 0:
                    _check_deadline(deadline)  # one chain can hold thousands of claims
                a, b = sides[k], sides[k + 1]
                if not a or not b:
                    continue
                start, end = a[0].start, b[-1].end
                claims.append(Claim("equation", text[a[0].start:a[-1].end],
                                    text[b[0].start:b[-1].end], start, end,
                                    approx=rels[k] == "≈"))
            eq_spans.append((toks[i].start, toks[j - 1].end))
        i = j
    # GSM8K calculator annotations (<<48/2=24>>) usually repeat the text's own claim: keep only
    # those that say something the text does not.
    def norm(x: str) -> str:
        return re.sub(r"[\s$]", "", x)

    seen = {(norm(c.lhs), norm(c.rhs)) for c in claims}
    for m in re.finditer(r"<<([^<>=]+)=([^<>=]+)>>", text):
        _check_deadline(deadline)
        if (norm(m.group(1)), norm(m.group(2))) not in seen:
            claims.append(Claim("equation", m.group(1).strip(), m.group(2).strip(), m.start(),
                                m.end()))
    # Spans are disjoint and in text order, and restatements are looked up by start: both
    # tests stay O(log n) / O(1) per match (a scan per match was quadratic on a long step).
    span_starts = [a for a, _ in eq_spans]
    restated: set[int] = set()
    for kind, pats in (("running_total", _RUNNING), ("final", _FINAL)):
        for pat in pats:
            for m in pat.finditer(clean):
                _check_deadline(deadline)
                s, e = m.span(1)
                if kind == "running_total" and _in_spans(s, span_starts, eq_spans):
                    continue  # the number is part of an equation, not a restatement
                if s in restated:
                    continue
                restated.add(s)
                claims.append(Claim(kind, "", m.group(1), s, e))  # type: ignore[arg-type]
    claims.sort(key=lambda c: (c.start, c.end))
    return claims


# ---------------------------------------------------------------------------------- checking
@dataclass
class _State:
    env: dict[sympy.Symbol, sympy.Expr] = field(default_factory=dict)
    last_result: sympy.Expr | None = None
    last_step: int = -10


def _numeric(e: sympy.Expr) -> bool:
    return not e.free_symbols


def _rounds_to(v: sympy.Expr, w: sympy.Rational, decimals: int) -> bool:
    """True when literal ``w`` is ``v`` rounded or truncated to ``decimals`` places, i.e. ``w`` is
    ``floor`` or ``ceil`` of ``v`` at that precision (an exactly representable ``v`` must match)."""
    scale = sympy.Integer(10) ** decimals
    x = v * scale
    if not x.is_Rational:
        x = sympy.Rational(str(sympy.N(x, 40)))  # irrational: 40 digits decide floor/ceil
    lo = sympy.floor(x)
    return bool(w * scale in (lo, lo + 1) if x != lo else w * scale == x)


def _close(a: sympy.Expr, b: sympy.Expr, ia: SideInfo, ib: SideInfo, *, approx: bool,
           rel_tol: float) -> bool:
    """Exact for rationals; a bare decimal literal may be rounded or truncated; ``≈`` within 1 %;
    anything else (irrationals) within ``rel_tol``."""
    if a.is_Rational and b.is_Rational and a == b:
        return True
    va, vb = sympy.N(a, 40), sympy.N(b, 40)
    if not (va.is_real and vb.is_real):
        d = abs(sympy.N(a - b, 40))
        return bool(d <= 1e-12 * max(1, abs(va), abs(vb)))
    scale = max(abs(va), abs(vb), 1)
    if approx:
        dec = max((i.decimals for i in (ia, ib) if i.bare), default=0)
        return bool(abs(va - vb) <= max(APPROX_REL_TOL * scale, 10.0 ** (-dec)))
    for val, lit, info in ((a, b, ib), (b, a, ia)):
        if info.bare and info.decimals and lit.is_Rational and _rounds_to(val, lit,
                                                                          info.decimals):
            return True
    if a.is_Rational and b.is_Rational:
        return False  # exact values that differ (1.5 * 4 = 6.1)
    return bool(abs(va - vb) <= float(rel_tol) * scale)


def _is_identity(a: sympy.Expr, b: sympy.Expr) -> bool:
    """``a == b`` for all values of the unknowns, tested at three fixed rational points.

    Why not ``expand(a - b)``: expansion of ``(a+b+c)^30 (d+e+f)^30`` is astronomically large,
    while exact evaluation at a point costs a few bounded-size big-integer operations. A
    non-identity agreeing at three generic points is possible in theory only.
    """
    syms = sorted(a.free_symbols | b.free_symbols, key=str)
    for k, base in enumerate((sympy.Rational(7, 3), sympy.Rational(-5, 11), sympy.Rational(13, 2))):
        point = {s: base + sympy.Rational(i * (k + 2), 17) for i, s in enumerate(syms)}
        va, vb = a.xreplace(point), b.xreplace(point)
        if va.free_symbols or vb.free_symbols:
            return False
        if va.is_Rational and vb.is_Rational:
            if va != vb:
                return False
        elif abs(sympy.N(va - vb, 40)) > 1e-20 * max(1, abs(sympy.N(va, 40))):
            return False
    return True


def _check_equation(c: Claim, st: _State, step_index: int, rel_tol: float) -> Claim:
    a, ia = parse_side(c.lhs)
    b, ib = parse_side(c.rhs)
    lhs_symbol = a if isinstance(a, sympy.Symbol) else None  # `x = 4` rebinds a bound x
    if st.env:
        a, b = a.xreplace(st.env), b.xreplace(st.env)
        a, b = check_finite(a), check_finite(b)
    if lhs_symbol is not None and _numeric(b):
        a = lhs_symbol
    if not (_numeric(a) and _numeric(b)):
        if isinstance(a, sympy.Symbol) and _numeric(b):
            st.env[a] = b
            st.last_result, st.last_step = b, step_index
            return replace(c, verdict="assignment", reason=f"{a} := {b}")
        if isinstance(b, sympy.Symbol) and _numeric(a):
            st.env[b] = a
            st.last_result, st.last_step = a, step_index
            return replace(c, verdict="assignment", reason=f"{b} := {a}")
        if _is_identity(a, b):
            return replace(c, verdict="valid", reason="identity")
        raise Uncheckable("equation in unknowns")
    ok = _close(a, b, ia, ib, approx=c.approx, rel_tol=rel_tol)
    st.last_result, st.last_step = b, step_index
    return replace(c, verdict="valid" if ok else "invalid",
                   reason="" if ok else f"{a} != {b}")


def _check_restatement(c: Claim, st: _State, step_index: int, rel_tol: float) -> Claim:
    if st.last_result is None or step_index - st.last_step > 1:
        raise Uncheckable("no recent result to compare with")
    v, info = parse_side(c.rhs)
    ok = _close(st.last_result, v, SideInfo(), info, approx=False, rel_tol=rel_tol)
    return replace(c, verdict="valid" if ok else "invalid",
                   reason="" if ok else f"last result was {st.last_result}")


def _check(c: Claim, st: _State, step_index: int, rel_tol: float) -> Claim:
    try:
        if c.kind == "equation":
            return _check_equation(c, st, step_index, rel_tol)
        return _check_restatement(c, st, step_index, rel_tol)
    except Uncheckable as e:
        return replace(c, verdict="uncheckable", reason=str(e))
    except (TypeError, ValueError, ZeroDivisionError, AttributeError,
            RecursionError, OverflowError) as e:
        # sympy corner cases (comparisons of odd objects) must not take a reward batch down.
        return replace(c, verdict="uncheckable", reason=f"{type(e).__name__}")


def verify_solution(solution: str, *, timeout_s: float = 1.0, rel_tol: float = 1e-6) -> StepReport:
    """Check the steps of ``solution``; see the module docstring for the rules.

    ``timeout_s`` is a budget for the whole call, finding claims as well as checking them (each
    claim's own cost is bounded by the parser's limits). Once it is spent the step in progress
    keeps what was checked, its other claims are uncheckable (``timeout``), and the steps after
    it are left out of the report (``timed_out``): a long solution is cut off at the budget
    instead of being split and searched to its end.
    """
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    st = _State()
    out: list[StepVerdict] = []
    timed_out = False
    for step in iter_steps(solution):
        claims = _claims_within(step, deadline)
        timed_out = claims is None
        checked: list[Claim] = []
        for c in claims or []:
            if timed_out or time.monotonic() > deadline:
                timed_out = True
                checked.append(replace(c, verdict="uncheckable", reason="timeout"))
                continue
            checked.append(_check(c, st, step.index, rel_tol))
        verdicts = {c.verdict for c in checked}
        verdict: Verdict = ("invalid" if "invalid" in verdicts
                            else "valid" if "valid" in verdicts else "uncheckable")
        out.append(StepVerdict(step.text, verdict, checked, step.end, step.start))
        if timed_out:
            break
    first = next((i for i, s in enumerate(out) if s.verdict == "invalid"), None)
    all_valid = first is None and any(s.verdict == "valid" for s in out)
    return StepReport(out, all_valid, first, time.monotonic() - t0, timed_out)


def _claims_within(step: Step, deadline: float) -> list[Claim] | None:
    """The step's claims, ``[]`` for an over-long step, or None once the budget is spent."""
    if len(step.text) > MAX_STEP_CHARS:
        return []
    try:
        return extract_claims(step, deadline=deadline)
    except _OutOfTime:
        return None
