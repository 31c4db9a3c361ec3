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

Safety: the text is untrusted model output, so it is never handed to ``sympy.sympify`` /
``parse_expr`` (they ``eval``); a small recursive-descent parser builds sympy objects directly and
refuses work whose cost is unbounded (exponents > 1000, results over ~30k bits, ``n!`` with
n > 1000, sides over 500 chars, numbers over 100 digits). A per-solution ``timeout_s`` budget
marks the remaining claims uncheckable once spent.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import sympy

Verdict = Literal["valid", "invalid", "uncheckable"]
ClaimVerdict = Literal["valid", "invalid", "uncheckable", "assignment", "unchecked"]

MAX_SIDE_CHARS = 500
MAX_DIGITS = 100
MAX_EXPONENT = 1000
MAX_RESULT_BITS = 30_000
MAX_SYMBOLIC_EXPONENT = 30
MAX_FACTORIAL = 1000
APPROX_REL_TOL = 1e-2


class Uncheckable(Exception):
    """A claim that cannot (or must not, for cost) be evaluated; the message says why."""


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
    """All steps of one solution.

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


def split_steps(solution: str) -> list[Step]:
    """Split into non-empty lines, and lines into sentences (". " before a capital letter).

    A decimal point never splits (``3.5``: no space after the dot). Offsets index ``solution``.
    """
    steps: list[Step] = []
    pos = 0
    for line in solution.splitlines(keepends=True):
        bounds = [0, *(m.end() for m in _SENTENCE_END.finditer(line)), len(line)]
        for a, b in zip(bounds[:-1], bounds[1:], strict=True):
            piece = line[a:b]
            stripped = piece.strip()
            if stripped:
                start = pos + a + (len(piece) - len(piece.lstrip()))
                steps.append(Step(len(steps), stripped, start, start + len(stripped)))
        pos += len(line)
    return steps


# ------------------------------------------------------------------------ length-preserving prep
# LaTeX / unicode spellings rewritten to the parser's operators. Every replacement has the length
# of what it replaces, so offsets in the cleaned text are offsets in the step text.
_REWRITES: list[tuple[re.Pattern[str], str | Callable[[re.Match[str]], str]]] = [
    (re.compile(r"<<[^<>]*>>"), lambda m: " " * len(m.group())),  # claims taken separately
    (re.compile(r"\\(?:text|mathrm|textbf|mbox|textit|operatorname)\s*\{[^{}]*\}"),
     lambda m: " " * len(m.group())),  # units / words inside math
    (re.compile(r"\\(?:cdot|times|ast)(?![A-Za-z])"), lambda m: "*".ljust(len(m.group()))),
    (re.compile(r"\\div(?![A-Za-z])"), lambda m: "/".ljust(len(m.group()))),
    (re.compile(r"\\approx(?![A-Za-z])"), lambda m: "≈".ljust(len(m.group()))),
    (re.compile(r"\\(?:neq|ne|leq|le|geq|ge|lt|gt|to|implies|Rightarrow)(?![A-Za-z])"),
     lambda m: ";".ljust(len(m.group()))),  # relations we do not check end a claim
    (re.compile(r"\\[dt]frac(?![A-Za-z])"), lambda m: "\\frac".ljust(len(m.group()))),
    (re.compile(r"\\(?:left|right|big|Big|bigg|Bigg)(?![A-Za-z])"),
     lambda m: " " * len(m.group())),
    (re.compile(r"\\(?:quad|qquad)(?![A-Za-z])|\\[,;:! ]"), lambda m: " " * len(m.group())),
    (re.compile(r"\\%"), lambda m: "% "),
    (re.compile(r"\\\$|\\\(|\\\)|\\\[|\\\]"), lambda m: "  "),
    (re.compile(r"[×✕]"), lambda m: "*"),
    (re.compile(r"[÷]"), lambda m: "/"),
    (re.compile(r"[−]"), lambda m: "-"),
    (re.compile(r"[·]"), lambda m: "*"),
]


def _clean(text: str) -> str:
    for pat, rep in _REWRITES:
        text = pat.sub(rep, text)
    return text


_TOKEN = re.compile(
    r"(?P<num>\d{1,3}(?:,\d{3})+(?:\.\d+)?(?![\d])|\d+(?:\.\d+)?|\.\d+)"
    r"|(?P<cmd>\\[A-Za-z]+)"
    r"|(?P<word>[A-Za-z]+)"
    r"|(?P<op>[-+*/^=()\[\]{}%!≈])"
    r"|(?P<dollar>\$)"
    r"|(?P<ws>\s+)"
    r"|(?P<other>.)",
    re.S,
)


@dataclass
class _Tok:
    kind: str  # num | cmd | word | op | dollar | ws | other
    text: str
    start: int
    end: int


def _tokenize(text: str) -> list[_Tok]:
    toks = [_Tok(m.lastgroup or "other", m.group(), m.start(), m.end())
            for m in _TOKEN.finditer(text)]
    # "3 x 4": an `x` between two operands, spaced, is a times sign, not a variable.
    solid = [i for i, t in enumerate(toks) if t.kind != "ws"]
    for k in range(1, len(solid) - 1):
        prev, cur, nxt = toks[solid[k - 1]], toks[solid[k]], toks[solid[k + 1]]
        if (cur.kind == "word" and cur.text == "x" and (prev.kind == "num" or prev.text == ")")
                and (nxt.kind == "num" or nxt.text == "(") and solid[k] - solid[k - 1] > 1
                and solid[k + 1] - solid[k] > 1):
            cur.kind, cur.text = "op", "*"
    return toks


def _is_math(t: _Tok) -> bool:
    return (t.kind in ("num", "cmd", "op", "dollar", "ws")
            or (t.kind == "word" and len(t.text) == 1))


# Words that continue an expression: a claim right after "of"/"times" lost its left operand.
_OPERATOR_WORDS = {"of", "times", "by", "plus", "minus", "over", "per", "divided", "multiplied",
                   "than", "less", "more", "into", "squared", "cubed", "percent", "half",
                   "twice", "thrice", "double", "triple", "sqrt", "root"}


# ------------------------------------------------------------------------------------- parser
@dataclass
class _SideInfo:
    decimals: int = 0  # most decimal places among the literals
    bare: bool = False  # the side is one literal (optionally signed / boxed)


class _Parser:
    """Recursive descent over tokens -> sympy (plain arithmetic + the common LaTeX)."""

    def __init__(self, toks: list[_Tok]) -> None:
        self.toks = [t for t in toks if t.kind not in ("ws", "dollar")]
        self.i = 0
        self.info = _SideInfo()

    def peek(self) -> _Tok | None:
        return self.toks[self.i] if self.i < len(self.toks) else None

    def take(self, text: str | None = None) -> _Tok:
        t = self.peek()
        if t is None or (text is not None and t.text != text):
            raise Uncheckable(f"expected {text or 'more'}")
        self.i += 1
        return t

    def parse(self) -> sympy.Expr:
        if not self.toks:
            raise Uncheckable("empty side")
        e = self.expr()
        if self.peek() is not None:
            raise Uncheckable(f"unexpected {self.peek().text!r}")  # type: ignore[union-attr]
        nums = [t for t in self.toks if t.kind == "num"]
        ops = [t.text for t in self.toks if t.kind != "num"]
        self.info.bare = len(nums) == 1 and all(o in ("-", "+", "\\boxed", "{", "}")
                                                for o in ops)
        return _check_finite(e)

    def expr(self) -> sympy.Expr:
        e = self.term()
        while (t := self.peek()) is not None and t.text in ("+", "-"):
            self.i += 1
            rhs = self.term()
            e = e + rhs if t.text == "+" else e - rhs
        return e

    def _starts_atom(self, t: _Tok) -> bool:
        return (t.kind in ("word", "cmd") or t.text in ("(", "[")) and t.text != "\\boxed"

    def term(self) -> sympy.Expr:
        e = self.factor()
        while (t := self.peek()) is not None:
            if t.text in ("*", "/"):
                self.i += 1
                rhs = self.factor()
                if t.text == "*":
                    e = e * rhs
                else:
                    if rhs == 0:
                        raise Uncheckable("division by zero")
                    e = e / rhs
            elif self._starts_atom(t):
                prev = self.toks[self.i - 1]
                if prev.kind == "num" and t.text == "\\frac":
                    raise Uncheckable("mixed number or product? (2\\frac{1}{2})")
                e = e * self.factor()  # implicit product: 2x, 3(4+1), (2)(3)
            else:
                break
        return e

    def factor(self) -> sympy.Expr:
        t = self.peek()
        if t is not None and t.text in ("-", "+"):
            self.i += 1
            f = self.factor()
            return -f if t.text == "-" else f
        return self.power()

    def power(self) -> sympy.Expr:
        base = self.postfix()
        if (t := self.peek()) is not None and t.text == "^":
            self.i += 1
            return _pow(base, self.factor())
        return base

    def postfix(self) -> sympy.Expr:
        e = self.atom()
        while (t := self.peek()) is not None and t.text in ("%", "!"):
            self.i += 1
            if t.text == "%":
                e = e / 100
            else:
                if not (e.is_Integer and 0 <= e <= MAX_FACTORIAL):
                    raise Uncheckable("factorial of a large or non-integer value")
                e = sympy.factorial(e)
        return e

    def group(self) -> sympy.Expr:
        """A LaTeX argument: ``{...}`` or a single digit / letter (``\\frac12``)."""
        t = self.take()
        if t.text == "{":
            e = self.expr()
            self.take("}")
            return e
        if t.kind == "num" and t.text.isdigit():
            if len(t.text) > 1:  # \frac12: the first digit is this argument, the rest the next
                self.toks.insert(self.i, _Tok("num", t.text[1:], t.start + 1, t.end))
            return sympy.Integer(t.text[0])
        if t.kind == "word" and len(t.text) == 1:
            return sympy.Symbol(t.text)
        raise Uncheckable(f"bad LaTeX argument {t.text!r}")

    def atom(self) -> sympy.Expr:
        t = self.take()
        if t.kind == "num":
            digits = t.text.replace(",", "")
            if len(digits) > MAX_DIGITS:
                raise Uncheckable("number too long")
            if "." in digits:
                self.info.decimals = max(self.info.decimals, len(digits.split(".")[1]))
            return sympy.Rational(digits)  # exact: Rational("0.1") == 1/10
        if t.text in ("(", "[", "{"):
            e = self.expr()
            self.take({"(": ")", "[": "]", "{": "}"}[t.text])
            return e
        if t.kind == "word" and len(t.text) == 1:
            return sympy.Symbol(t.text)
        if t.kind == "cmd":
            if t.text == "\\frac":
                num = self.group()
                den = self.group()
                if den == 0:
                    raise Uncheckable("division by zero")
                return num / den
            if t.text == "\\sqrt":
                n: sympy.Expr = sympy.Integer(2)
                if (p := self.peek()) is not None and p.text == "[":
                    self.i += 1
                    n = self.expr()
                    self.take("]")
                if n == 0:
                    raise Uncheckable("zeroth root")
                return _pow(self.group(), 1 / n)
            if t.text == "\\pi":
                return sympy.pi
            if t.text == "\\boxed":
                return self.group()
            raise Uncheckable(f"unsupported LaTeX {t.text}")
        raise Uncheckable(f"unexpected {t.text!r}")


def _bits(x: sympy.Rational) -> int:
    return max(int(x.p).bit_length(), int(x.q).bit_length())


def _pow(base: sympy.Expr, exp: sympy.Expr) -> sympy.Expr:
    """``base ** exp`` after refusing anything whose evaluation cost is unbounded."""
    if exp.is_Rational:
        if abs(exp.p) > MAX_EXPONENT or exp.q > 100:
            raise Uncheckable("exponent too large")
        if base.is_Rational:
            if _bits(base) * abs(int(exp.p)) > MAX_RESULT_BITS * int(exp.q):
                raise Uncheckable("power too large")
            if exp.q > 1 and _bits(base) > 2000:
                raise Uncheckable("root of a huge number")
            if base == 0 and exp < 0:
                raise Uncheckable("division by zero")
        elif base.free_symbols and abs(exp) > MAX_SYMBOLIC_EXPONENT:
            raise Uncheckable("symbolic power too large")
    elif exp.free_symbols or base.free_symbols:
        pass  # stays an unevaluated symbolic power
    else:
        mag = abs(sympy.N(exp, 15))
        if not mag.is_finite or mag > MAX_EXPONENT:
            raise Uncheckable("exponent too large")
    return _check_finite(base**exp)


def _check_finite(e: sympy.Expr) -> sympy.Expr:
    if e.has(sympy.zoo, sympy.nan, sympy.oo, -sympy.oo):
        raise Uncheckable("undefined value")
    return e


_FALLBACK_SAFE = re.compile(r"^[^\^!]{1,200}$")


def parse_side(text: str) -> tuple[sympy.Expr, _SideInfo]:
    """Parse one side of a claim (plain arithmetic or LaTeX) into a sympy expression.

    Unknown LaTeX commands (``\\sin``, ``\\binom``, ``\\log``) fall back to
    ``latex2sympy2_extended`` but only for short texts without powers/factorials and with small
    literals, so the fallback cannot blow up either. Raises :class:`Uncheckable`.
    """
    if len(text) > MAX_SIDE_CHARS:
        raise Uncheckable("side too long")
    p = _Parser(_tokenize(_clean(text)))
    try:
        return p.parse(), p.info
    except Uncheckable as e:
        if not str(e).startswith("unsupported LaTeX"):
            raise
        if not _FALLBACK_SAFE.match(text) or any(len(n) > 4 for n in re.findall(r"\d+", text)):
            raise
    from latex2sympy2_extended import latex2sympy

    try:
        expr = latex2sympy(text)
    except Exception as err:  # noqa: BLE001 - any parser failure is simply "uncheckable"
        raise Uncheckable(f"latex parse failed: {type(err).__name__}") from None
    if not isinstance(expr, sympy.Expr):
        raise Uncheckable("not an expression")
    return _check_finite(expr), _SideInfo()


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


def _trim(toks: list[_Tok]) -> list[_Tok]:
    """Drop surrounding whitespace and a stray spaced single letter ("a 3 + 4", "= 7 a")."""
    def strip_ws(ts: list[_Tok]) -> list[_Tok]:
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


def _split_sides(run: list[_Tok]) -> tuple[list[list[_Tok]], list[str]]:
    """Split a run at top-level ``=`` / ``≈``; returns sides and the relation between each pair."""
    sides: list[list[_Tok]] = [[]]
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


def _neighbour_word(toks: list[_Tok], i: int, step: int) -> str:
    j = i + step
    while 0 <= j < len(toks) and toks[j].kind == "ws":
        j += step
    return toks[j].text.lower() if 0 <= j < len(toks) and toks[j].kind == "word" else ""


def extract_claims(step: Step | str) -> list[Claim]:
    """All claims of a step, in text order, unchecked (``verdict="unchecked"``)."""
    text = step.text if isinstance(step, Step) else step
    claims: list[Claim] = []
    clean = _clean(text)
    toks = _tokenize(clean)
    eq_spans: list[tuple[int, int]] = []
    i = 0
    while i < len(toks):
        if not _is_math(toks[i]):
            i += 1
            continue
        j = i
        while j < len(toks) and _is_math(toks[j]):
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
        if (norm(m.group(1)), norm(m.group(2))) not in seen:
            claims.append(Claim("equation", m.group(1).strip(), m.group(2).strip(), m.start(),
                                m.end()))
    for kind, pats in (("running_total", _RUNNING), ("final", _FINAL)):
        for pat in pats:
            for m in pat.finditer(clean):
                s, e = m.span(1)
                if any(a <= s < b for a, b in eq_spans) and kind == "running_total":
                    continue  # the number is part of an equation, not a restatement
                if any(c.kind != "equation" and c.start == s for c in claims):
                    continue
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


def _close(a: sympy.Expr, b: sympy.Expr, ia: _SideInfo, ib: _SideInfo, *, approx: bool,
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
        a, b = _check_finite(a), _check_finite(b)
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
    ok = _close(st.last_result, v, _SideInfo(), info, approx=False, rel_tol=rel_tol)
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
    """Check every step of ``solution``; see the module docstring for the rules.

    ``timeout_s`` is a budget for the whole solution, checked between claims (each claim's own cost
    is bounded by the parser's limits); claims left when it runs out are uncheckable.
    """
    t0 = time.monotonic()
    st = _State()
    out: list[StepVerdict] = []
    timed_out = False
    for step in split_steps(solution):
        checked: list[Claim] = []
        for c in extract_claims(step):
            if time.monotonic() - t0 > timeout_s:
                timed_out = True
                checked.append(replace(c, verdict="uncheckable", reason="timeout"))
                continue
            checked.append(_check(c, st, step.index, rel_tol))
        verdicts = {c.verdict for c in checked}
        verdict: Verdict = ("invalid" if "invalid" in verdicts
                            else "valid" if "valid" in verdicts else "uncheckable")
        out.append(StepVerdict(step.text, verdict, checked, step.end, step.start))
    first = next((i for i, s in enumerate(out) if s.verdict == "invalid"), None)
    all_valid = first is None and any(s.verdict == "valid" for s in out)
    return StepReport(out, all_valid, first, time.monotonic() - t0, timed_out)


# ------------------------------------------------------------------------- token alignment
def char_to_token_index(text: str, char_pos: int, tokenizer: Any,
                        ids: Sequence[int] | None = None) -> int:
    """Index of the token of ``ids`` (default ``tokenizer.encode(text)``) containing ``char_pos``.

    Uses prefix decodes (``len(decode(ids[:k]))``, binary search), so it works for any tokenizer
    with ``decode``, including byte-level BPE where tokens and characters do not align. A position
    past the end maps to the last token. ``text`` should be ``decode(ids)``.
    """
    if ids is None:
        ids = tokenizer.encode(text)
    ids = list(ids)
    if not ids:
        raise ValueError("no tokens")
    lo, hi = 1, len(ids)  # smallest k with len(decode(ids[:k])) > char_pos
    if len(tokenizer.decode(ids)) <= char_pos:
        return len(ids) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if len(tokenizer.decode(ids[:mid])) > char_pos:
            hi = mid
        else:
            lo = mid + 1
    return lo - 1


def step_token_ends(report: StepReport, text: str, tokenizer: Any,
                    ids: Sequence[int] | None = None) -> list[int]:
    """For every step of ``report`` (from ``verify_solution(text)``), the index of the token that
    holds its last character -- the ``token_ends`` row ``process_rewards`` expects."""
    if ids is None:
        ids = tokenizer.encode(text)
    return [char_to_token_index(text, max(s.char_end - 1, 0), tokenizer, ids)
            for s in report.steps]
