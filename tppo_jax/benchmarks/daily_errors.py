"""Where the ``daily`` task's wrong answers go wrong: the first mistake of each completion.

Reads the text ``tppo eval RUN --greedy --show N`` prints (prompt, completion, grade per
question) and classifies each wrong completion by its first error, line by line against the
question: the day count or start value copied wrong, the step copied wrong, an arithmetic
slip, a carried value that is not the previous line's result, stopping early or running on, a
boxed answer that is not the last line's result. Line 1 is told apart from later lines, since
credit from the final reward reaches the first line least.

    tppo eval RUN --greedy --show 64 > after.txt
    python -m tppo_jax.benchmarks.daily_errors before.txt after.txt
"""

from __future__ import annotations

import argparse
import collections
import re

import sympy

from tppo_jax.data.synthetic import apply_op

# ``Problem.question`` and ``SyntheticMathTask.solve`` (daily style) written as patterns; the
# tests check them against generated problems so the two cannot drift apart.
QUESTION = re.compile(r"has (\d+) \w+\. Each day \w+ (gets|gives away) (\d+)(?: more)?\. "
                      r"How many \w+ after (\d+) days")
LINE = re.compile(r"day (\d+) of (\d+): (\d+) ([+-]) (\d+) = (\d+)$")


def first_error(question: str, completion: str) -> str:
    """The first mistake of a ``daily`` completion against its question ("none" when every
    line, the day count and the boxed answer are right; "unparsed" for another task)."""
    q = QUESTION.search(question)
    if q is None:
        return "unparsed"
    value, sign, step, days = int(q[1]), "+" if q[2] == "gets" else "-", int(q[3]), int(q[4])
    lines = [x for x in completion.split("\n") if x.startswith("day")]
    for i, text in enumerate(lines):
        where = "line 1" if i == 0 else "later line"
        m = LINE.match(text)
        if m is None:
            return f"malformed ({where})"
        k, n, a, s, b, c = int(m[1]), int(m[2]), int(m[3]), m[4], int(m[5]), int(m[6])
        if n != days:
            return f"day count copied wrong ({where})"
        if k != i + 1:
            return f"day index wrong ({where})"
        if a != value:
            return "start value copied wrong (line 1)" if i == 0 else "carried value wrong"
        if (s, b) != (sign, step):
            return f"step copied wrong ({where})"
        if c != apply_op(sympy.Integer(a), s, b):
            return f"arithmetic slip ({where})"
        value = c
    if len(lines) != days:
        return "stopped early" if len(lines) < days else "ran past the last day"
    boxed = re.search(r"\\boxed\{(-?\d+)\}", completion)
    if boxed is None:
        return "no boxed answer"
    return "none" if int(boxed[1]) == value else "boxed != last result"


def parse_show(text: str) -> list[tuple[str, str, bool]]:
    """``(prompt, completion, graded correct)`` per block of ``tppo eval --show`` output."""
    out = []
    for block in text.split("=== prompt\n")[1:]:
        prompt, rest = block.split("\n--- completion\n", 1)
        completion, grade = rest.rsplit("\n--- answer ", 1)
        out.append((prompt, completion, ": ok (" in grade.split("\n", 1)[0]))
    return out


def tally(text: str) -> dict[str, int]:
    """Counts of first errors over the wrong completions (and "correct")."""
    counts = collections.Counter(
        "correct" if ok else first_error(p, c) for p, c, ok in parse_show(text))
    return dict(counts.most_common())


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("files", nargs="+", help="saved output of tppo eval --show")
    for f in p.parse_args(argv).files:
        with open(f) as fh:
            print(f, tally(fh.read()))


if __name__ == "__main__":
    main()
