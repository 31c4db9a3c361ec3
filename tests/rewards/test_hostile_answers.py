"""Hostile completions against the math grading pool (issue 8, item 3).

Over a thousand adversarial completions -- huge powers and factorial towers, nesting thousands
deep, megabyte strings, invalid LaTeX, unbalanced braces, unicode/RTL/zero-width/emoji, NUL
bytes, empty boxes, many boxes, very long digit strings -- are graded in batches against real
ground truths. The pool must never hang (each batch ends within its deadline plus a little
slack), give every item a known reason, stay usable, and leave no worker process behind.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator

import psutil
import pytest

from tppo_jax.rewards.grader import REASONS, MathGrader

# Real ground truths as they appear in GSM8K / MATH / DAPO: integers, fractions, LaTeX.
GROUND_TRUTHS = [
    "3", "42", "-7", "1000000", "2400", "0", "204", r"\frac{1}{2}", r"\frac{3}{4}", "0.5",
    r"\sqrt{2}", r"2\sqrt{3}", r"2\pi", r"\frac{\pi}{6}", r"x^2+1", r"(1, 2)", r"\infty",
    r"\dfrac{7}{12}", "10^{6}", r"3\sqrt{2}",
]

ITEM_TIMEOUT_S = 0.8  # > a fresh worker's sympy first-use cost (~0.35 s), see report
BATCH_DEADLINE_S = 10.0
BATCH_SIZE = 128
SLACK_S = 2.5  # killing stuck workers + a loaded 2-core box


def _nest(open_: str, close: str, depth: int, core: str = "1") -> str:
    return open_ * depth + core + close * depth


def _expensive(rng: random.Random) -> list[str]:
    """Completions that can keep sympy busy far beyond any sane per-item budget.

    Each one costs a worker kill + respawn (~1 s on a loaded 2-core box), so this family is
    kept to one or two of each kind; the cheap families below make up the bulk of the corpus.
    """
    base = rng.randint(2, 99)
    return [
        r"\boxed{9^9^9^9^9}",  # left-assoc: huge but computable, simply wrong
        r"\boxed{" + "^".join([str(base)] * 6) + "}",
        r"\boxed{" + _nest(f"{base}^{{", "}", 5, str(base)) + "}",
        r"\boxed{10^{10^{10}}}",
        r"$\boxed{2^{2^{2^{2^{2^{2}}}}}}$",
        r"\boxed{9^{9^{9^{9^9}}}}",
        r"\boxed{(10^{100})!}",  # factorial towers
        r"\boxed{" + _nest("(", ")!", 5, str(rng.randint(10, 99))) + "}",
        r"\boxed{" + str(rng.randint(100, 999)) + "!!!!}",
        r"\boxed{" + _nest("(", ")", 3000) + "}",  # nesting thousands deep
        r"\boxed{" + _nest("{", "}", 5000) + "}",
        r"\boxed{" + _nest(r"\left(", r"\right)", 1000) + "}",
        r"\boxed{" + _nest(r"\frac{1}{", "}", 10_000, "2") + "}",  # 10k nested \frac
        r"\boxed{" + _nest(r"\sqrt{", "}", 2000, "2") + "}",
        r"\boxed{" + "1+" * 300_000 + "1}",  # 600 kB expression
        r"\boxed{" + "7" * 1_000_000 + "}",  # a million digits
        r"\boxed{" + "9" * 100_000 + "}",
    ]


def _cheap(rng: random.Random) -> list[str]:
    """Completions that must be graded quickly (and mostly as wrong / no_answer)."""
    out: list[str] = []
    weird = ["\u202e", "\u202d", "\u200f", "\u200b", "\u200d", "\ufeff", "\u2066", "\u00a0",
             "\U0001f600", "\U0001f468\u200d\U0001f469\u200d\U0001f467", "\u0301", "\uff13",
             "\u0663", "\u221e", "\u2212", "\ud800", "\udfff", "\x00", "\x1b[31m", "\r", "\t",
             "\u0000\u0000", "\U0010ffff", "\u05d0\u05d1", "\u0627\u0644"]
    for _ in range(200):  # unicode sprinkled in and around the box
        gt = rng.choice(GROUND_TRUTHS)
        w = "".join(rng.choice(weird) for _ in range(rng.randint(1, 6)))
        mode = rng.randrange(4)
        if mode == 0:
            out.append(f"{w} so {w} the answer {w} is \\boxed{{{gt}}}{w}")
        elif mode == 1:
            out.append(f"\\boxed{{{w}{gt}{w}}}")
        elif mode == 2:
            out.append(f"\\boxed{{{gt[: len(gt) // 2]}{w}{gt[len(gt) // 2:]}}}")
        else:
            out.append(w * rng.randint(1, 2000))
    for _ in range(60):  # NUL bytes everywhere
        gt = rng.choice(GROUND_TRUTHS)
        out.append("\x00" * rng.randint(0, 50) + f"\\boxed{{\x00{gt}\x00}}" + "\x00" * 3)
        out.append(f"\\boxed\x00{{{gt}}}")
    out += ["", " ", "\n\n\n", "\t", r"\boxed{}", r"\boxed{ }", r"\boxed{{}}", r"\boxed",
            r"\boxed{", r"\boxed}", r"\fbox{}", r"\boxed{}\boxed{}", "$$", r"\boxed{$}",
            r"\boxed{\boxed{}}", r"\boxed{\,}", r"\boxed{\quad}", r"\boxed{~}", r"\boxed {}",
            r"\boxedx", "boxed{3}", r"\\boxed{3}", r"\boxed{\text{}}", r"\boxed{\phantom{3}}"] * 3
    for _ in range(120):  # unbalanced braces
        gt = rng.choice(GROUND_TRUTHS)
        junk = "".join(rng.choice("{{}}()[]$\\") for _ in range(rng.randint(1, 40)))
        out.append(rng.choice([f"\\boxed{{{gt}{junk}", f"\\boxed{{{junk}{gt}}}",
                               f"{junk}\\boxed{{{gt}}}{junk}", f"\\boxed{junk}"]))
    cmds = [r"\frac", r"\sqrt", r"\left(", r"\right)", r"\begin{pmatrix}", r"\end{array}", "^",
            "_", "&", r"\\", r"\int", r"\sum_{i=1}^{\infty}", r"\lim", r"\mathbb{R}", r"\over",
            r"\cdot", r"\times", r"\pm", "{", "}", "1", "x", "=", r"\le", r"\text{foo", r"\%",
            r"\$", "#", r"\undefinedmacro", r"\operatorname{", r"\displaystyle", ",", ";", "."]
    for _ in range(220):  # invalid LaTeX soup
        soup = " ".join(rng.choice(cmds) for _ in range(rng.randint(1, 25)))
        out.append(rng.choice([f"\\boxed{{{soup}}}", f"${soup}$ \\boxed{{{soup}}}", soup]))
    for n in (10, 100, 1000, 5000, 20_000):  # many boxes
        out.append(r"\boxed{1}" * n)
        out.append("".join(f"\\boxed{{{rng.choice(GROUND_TRUTHS)}}} " for _ in range(n)))
        out.append(r"\boxed{" * n)
    for _ in range(70):  # very long digit strings (bounded so they stay cheap)
        digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(50, 5000)))
        out.append(rng.choice([f"\\boxed{{{digits}}}", f"\\boxed{{0.{digits}}}",
                               f"\\boxed{{-{digits}}}", f"{digits} \\boxed{{{digits[:3]}}}"]))
    for _ in range(3):  # megabyte strings, answer cheap to find
        gt = rng.choice(GROUND_TRUTHS)
        out.append("lorem ipsum " * 90_000 + f"\\boxed{{{gt}}}")
        out.append(rng.choice("{}()$\\") * 1_000_000)
    for _ in range(150):  # random printable / binary-ish junk
        n = rng.randint(0, 300)
        out.append("".join(chr(rng.randint(0, 0x2FFF)) for _ in range(n)))
    return out


def _corpus() -> list[tuple[str, str]]:
    rng = random.Random(8)
    comps = _cheap(rng) + _expensive(rng)
    items = [(c, rng.choice(GROUND_TRUTHS)) for c in comps]
    items += [(f"work... \\boxed{{{gt}}}", gt) for gt in GROUND_TRUTHS]  # controls
    rng.shuffle(items)  # spread the expensive ones over the batches
    return items


def _batches(items: list[tuple[str, str]], size: int) -> Iterator[list[tuple[str, str]]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


def _descendants() -> dict[int, str]:
    """Live (non-zombie) descendant processes of this test process, by pid."""
    out = {}
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                out[p.pid] = " ".join(p.cmdline())
        except psutil.Error:  # exited meanwhile
            continue
    return out


def _infrastructure(cmdline: str) -> bool:
    """multiprocessing's shared helpers, started once per test session, not per grader."""
    return "forkserver" in cmdline or "resource_tracker" in cmdline


def _assert_gone(pids: set[int], timeout_s: float = 3.0) -> None:
    end = time.monotonic() + timeout_s
    alive = set(pids)
    while alive and time.monotonic() < end:
        alive = {p for p in alive if _running(p)}
        if alive:
            time.sleep(0.05)
    assert not alive, f"worker processes leaked: {sorted(alive)}"


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def test_corpus_is_big_and_varied() -> None:
    items = _corpus()
    assert len(items) >= 1000
    assert any(len(c) >= 1_000_000 for c, _ in items)
    assert any("\x00" in c for c, _ in items) and any(c == "" for c, _ in items)


@pytest.mark.slow  # ~30 s on 2 shared cores: every hung item costs a worker kill + respawn
def test_thousand_hostile_completions_never_hang() -> None:
    before = _descendants()
    items = _corpus()
    seen_workers: set[int] = set()
    totals = dict.fromkeys(REASONS, 0)
    g = MathGrader(num_workers=2, item_timeout_s=ITEM_TIMEOUT_S,
                   batch_deadline_s=BATCH_DEADLINE_S)
    try:
        for batch in _batches(items, BATCH_SIZE):
            seen_workers.update(p for p in g.worker_pids() if p)
            comps = [c for c, _ in batch]
            answers = [a for _, a in batch]
            t0 = time.monotonic()
            r = g.grade(comps, answers)
            wall = time.monotonic() - t0
            seen_workers.update(p for p in g.worker_pids() if p)
            assert wall < BATCH_DEADLINE_S + SLACK_S, f"batch took {wall:.1f}s"
            assert len(r.reasons) == len(batch) == len(r.rewards) == len(r.correct)
            assert set(r.reasons) <= set(REASONS)
            assert set(r.counts) == set(REASONS)
            assert sum(r.counts.values()) == len(batch)
            for k in REASONS:
                assert r.counts[k] == r.reasons.count(k)
                totals[k] += r.counts[k]
            assert all(c == (x == "ok") for c, x in zip(r.correct, r.reasons, strict=True))
        assert sum(totals.values()) == len(items)
        assert totals["timeout"] > 0  # the expensive ones were really cut off ...
        assert g.stats["killed"] > 0
        assert totals["wrong"] + totals["no_answer"] > len(items) // 2  # ... the rest graded
        # Still a working grader afterwards.
        r = g.grade([r"so \boxed{19}", r"\boxed{\frac{2}{4}}", r"\boxed{18}", "no box"],
                    ["19", "0.5", "19", "19"])
        assert r.reasons == ["ok", "ok", "wrong", "no_answer"]
        seen_workers.update(p for p in g.worker_pids() if p)
    finally:
        g.close()
    _assert_gone(seen_workers)
    leaked = {pid: cmd for pid, cmd in _descendants().items()
              if pid not in before and not _infrastructure(cmd) and _running(pid)}
    assert not leaked, f"processes left after close: {leaked}"


def test_all_hanging_batch_is_cut_at_the_deadline() -> None:
    """Inner math-verify timeout off and a long item timeout: only the batch deadline ends it."""
    rng = random.Random(3)
    hang = _expensive(rng)[3:11]
    deadline = 1.5
    with MathGrader(num_workers=2, item_timeout_s=30.0, batch_deadline_s=deadline,
                    mv_timeout_s=None) as g:
        t0 = time.monotonic()
        r = g.grade(hang, ["3"] * len(hang))
        assert time.monotonic() - t0 < deadline + SLACK_S
        assert set(r.reasons) <= {"wrong", "no_answer", "timeout"}
        assert r.counts["timeout"] >= 2  # both workers were stuck and killed at the deadline
        pids = set(g.worker_pids())
        assert g.grade([r"\boxed{7}"], ["7"]).reasons == ["ok"]
    _assert_gone({p for p in pids if p})
