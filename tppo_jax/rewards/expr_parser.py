"""Safe arithmetic expression parser: one side of a claim (plain arithmetic or LaTeX) -> sympy.

The text is untrusted model output, so it is never handed to ``sympy.sympify`` / ``parse_expr``
(they ``eval``); a small recursive-descent parser builds sympy objects directly and refuses work
whose cost is unbounded (exponents > 1000, results over ~30k bits, ``n!`` with n > 1000, sides
over 500 chars, numbers over 100 digits), raising :class:`Uncheckable` with the reason.

Numbers are exact rationals (``0.1`` is ``1/10``); :class:`SideInfo` records how many decimals a
side's literals carry so the step verifier can accept a rounded literal. ``clean_text`` and
``tokenize`` are shared with the verifier's claim extraction, which finds the claims in the same
token stream.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import sympy

MAX_SIDE_CHARS = 500
MAX_DIGITS = 100
MAX_EXPONENT = 1000
MAX_RESULT_BITS = 30_000
MAX_SYMBOLIC_EXPONENT = 30
MAX_FACTORIAL = 1000


class Uncheckable(Exception):
    """A claim that cannot (or must not, for cost) be evaluated; the message says why."""


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


def clean_text(text: str) -> str:
    """Rewrite LaTeX / unicode operators to the parser's; the result has the length of ``text``."""
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
class Token:
    """One lexical token; ``start``/``end`` are offsets in the (cleaned) text."""

    kind: str  # num | cmd | word | op | dollar | ws | other
    text: str
    start: int
    end: int


def tokenize(text: str) -> list[Token]:
    """Tokens of ``text`` (whitespace included), a spaced ``x`` between operands read as ``*``."""
    toks = [Token(m.lastgroup or "other", m.group(), m.start(), m.end())
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


def is_math_token(t: Token) -> bool:
    """Whether ``t`` can be part of an expression (a one-letter word is a variable)."""
    return (t.kind in ("num", "cmd", "op", "dollar", "ws")
            or (t.kind == "word" and len(t.text) == 1))


# ------------------------------------------------------------------------------------- parser
@dataclass
class SideInfo:
    """What the verifier needs to know about how a side was written."""

    decimals: int = 0  # most decimal places among the literals
    bare: bool = False  # the side is one literal (optionally signed / boxed)


class _Parser:
    """Recursive descent over tokens -> sympy (plain arithmetic + the common LaTeX)."""

    def __init__(self, toks: list[Token]) -> None:
        self.toks = [t for t in toks if t.kind not in ("ws", "dollar")]
        self.i = 0
        self.info = SideInfo()

    def peek(self) -> Token | None:
        return self.toks[self.i] if self.i < len(self.toks) else None

    def take(self, text: str | None = None) -> Token:
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
        return check_finite(e)

    def expr(self) -> sympy.Expr:
        e = self.term()
        while (t := self.peek()) is not None and t.text in ("+", "-"):
            self.i += 1
            rhs = self.term()
            e = e + rhs if t.text == "+" else e - rhs
        return e

    def _starts_atom(self, t: Token) -> bool:
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
                self.toks.insert(self.i, Token("num", t.text[1:], t.start + 1, t.end))
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
    return check_finite(base**exp)


def check_finite(e: sympy.Expr) -> sympy.Expr:
    """``e`` itself, or :class:`Uncheckable` when it holds an infinity or nan."""
    if e.has(sympy.zoo, sympy.nan, sympy.oo, -sympy.oo):
        raise Uncheckable("undefined value")
    return e


_FALLBACK_SAFE = re.compile(r"^[^\^!]{1,200}$")


def parse_side(text: str) -> tuple[sympy.Expr, SideInfo]:
    """Parse one side of a claim (plain arithmetic or LaTeX) into a sympy expression.

    Unknown LaTeX commands (``\\sin``, ``\\binom``, ``\\log``) fall back to
    ``latex2sympy2_extended`` but only for short texts without powers/factorials and with small
    literals, so the fallback cannot blow up either. Raises :class:`Uncheckable`.
    """
    if len(text) > MAX_SIDE_CHARS:
        raise Uncheckable("side too long")
    p = _Parser(tokenize(clean_text(text)))
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
    return check_finite(expr), SideInfo()
