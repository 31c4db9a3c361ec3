"""The step verifier's ``timeout_s`` bounds the whole call, claim finding included.

Before, the budget was checked only between claim checks: every step was still split and
searched for claims (a scan per running total over the step's equations, quadratic on a long
line), so hostile text took several seconds against a 1 s budget inside the trainer process.
"""

from __future__ import annotations

import gc
import time

import pytest

from tppo_jax.rewards.step_verifier import (
    MAX_STEP_CHARS,
    extract_claims,
    iter_steps,
    verify_solution,
)

BUDGET_S = 0.25
SLACK_S = 1.0  # the old code took 4-7 s on each of these
# CPU time of this thread, not wall-clock: on a shared CI core the wall-clock of the same work
# stretches with the other jobs (1.47 s seen under `pytest -n 2`), the work done does not,
# and the threads JAX left running in a worker are not counted.
# What is timed is the verifier's own work: sympy's lazy first-use set-up is paid before the
# clock starts, and the collector is off while it runs (an xdist worker that ran other test
# files first holds a large heap; 1.31 CPU s was seen on CI for this 0.25 s budget there).

HOSTILE = {
    # long lines of equations and running totals (claim finding was quadratic per line)
    "restatements": "\n".join(["1 = 1, now has 1, " * 1100] * 12),
    # many short steps: each was split and searched after the budget ran out
    "many_steps": "1 + 1 = 2\n" * 40_000,
    # one chain of thousands of claims per line
    "chains": "\n".join(["1" + " = 1" * 4900] * 10),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_whole_call_within_budget(name: str) -> None:
    text = HOSTILE[name]
    verify_solution("2 + 3 = 5\nx = 4\nx + 1 = 5", timeout_s=5.0)  # sympy's first-use set-up
    gc.collect()
    gc.disable()
    try:
        t0 = time.thread_time()
        rep = verify_solution(text, timeout_s=BUDGET_S)
        elapsed = time.thread_time() - t0
    finally:
        gc.enable()
    assert elapsed < BUDGET_S + SLACK_S, f"{name}: {elapsed:.2f} CPU s for a {BUDGET_S} s budget"
    assert rep.timed_out
    assert rep.first_invalid is None  # cut off, never "invalid" because of the budget
    assert len(rep.steps) < len(list(iter_steps(text)))  # steps past the budget were not searched


def test_within_budget_report_is_unchanged() -> None:
    sol = "48 + 57 = 105\nShe now has 105 clips.\n105 - 5 = 100\n\\boxed{100}"
    rep = verify_solution(sol, timeout_s=5.0)
    assert not rep.timed_out and rep.all_valid
    assert [s.text for s in rep.steps] == [s.text for s in iter_steps(sol)]


def test_over_long_step_is_uncheckable_without_search() -> None:
    line = "1 + 1 = 2, " * (MAX_STEP_CHARS // 10)
    assert len(line) > MAX_STEP_CHARS
    rep = verify_solution(line + "\n2 + 2 = 4", timeout_s=5.0)
    assert [s.verdict for s in rep.steps] == ["uncheckable", "valid"]
    assert rep.steps[0].claims == [] and not rep.timed_out


def test_restatement_inside_an_equation_is_not_a_claim() -> None:
    # The span lookup (bisect) must agree with the scan it replaced.
    kinds = [c.kind for c in extract_claims("so 3 + 4 = 7 left, then 7 + 1 = 8, now has 8 pens")]
    assert kinds == ["equation", "equation", "running_total"]
