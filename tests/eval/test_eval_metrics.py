"""avg@k and unbiased pass@k against hand-computed numbers."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tppo_jax.eval.metrics import (
    avg_at_k,
    pass_at_k,
    pass_at_k_batch,
    pass_at_k_from_correct,
    summarize,
)


def test_avg_at_k_spec_anchors() -> None:
    assert avg_at_k(np.ones((3, 32), bool)) == 100.0
    half = np.zeros((4, 32), bool)
    half[:, ::2] = True
    assert avg_at_k(half) == 50.0
    assert avg_at_k(np.zeros((2, 8), bool)) == 0.0
    assert avg_at_k([[True, False, False, False]]) == 25.0
    assert avg_at_k([True, True, False, False]) == 50.0  # one question as a 1-D row
    assert math.isnan(avg_at_k(np.zeros((0, 4), bool)))


@pytest.mark.parametrize(
    ("n", "c", "k", "want"),
    [
        (5, 2, 2, 1 - 3 / 10),  # 1 - C(3,2)/C(5,2)
        (10, 3, 1, 0.3),  # pass@1 = c/n
        (10, 0, 1, 0.0),
        (10, 10, 5, 1.0),
        (4, 1, 4, 1.0),  # n - c < k: every draw of 4 contains the correct one
        (100, 1, 10, 0.1),
        (6, 2, 3, 1 - 4 / 20),  # 1 - C(4,3)/C(6,3)
    ],
)
def test_pass_at_k_hand_numbers(n: int, c: int, k: int, want: float) -> None:
    assert pass_at_k(n, c, k) == pytest.approx(want, abs=1e-12)


def test_pass_at_k_stable_for_large_n() -> None:
    n, c, k = 1000, 500, 100
    exact = 1 - math.comb(n - c, k) / math.comb(n, k)  # Python ints: exact reference
    assert pass_at_k(n, c, k) == pytest.approx(exact, rel=1e-12)
    assert pass_at_k(2000, 3, 1000) == pytest.approx(1 - math.comb(1997, 1000) /
                                                     math.comb(2000, 1000), rel=1e-12)


def test_pass_at_k_validation() -> None:
    for args in [(5, 6, 1), (5, 2, 0), (5, 2, 6), (5, -1, 1)]:
        with pytest.raises(ValueError):
            pass_at_k(*args)


def test_batch_and_from_correct() -> None:
    got = pass_at_k_batch(5, [0, 2, 5], 2)
    np.testing.assert_allclose(got, [0.0, 0.7, 1.0])
    np.testing.assert_allclose(pass_at_k_batch([5, 10], [2, 3], 1), [0.4, 0.3])
    correct = np.zeros((2, 4), bool)
    correct[0, :2] = True  # question 0: c=2 of 4; pass@1 = 0.5, pass@2 = 1 - C(2,2)/C(4,2)
    assert pass_at_k_from_correct(correct, 1) == pytest.approx(25.0)
    assert pass_at_k_from_correct(correct, 2) == pytest.approx(100 * (1 - 1 / 6) / 2)
    # pass@1 equals avg@k
    rng = np.random.default_rng(0)
    m = rng.random((7, 16)) < 0.3
    assert pass_at_k_from_correct(m, 1) == pytest.approx(avg_at_k(m))


def test_summarize() -> None:
    m = np.ones((2, 8), bool)
    m[1] = False
    s = summarize(m, ks=(1, 4, 32))
    assert s == {"avg@8": 50.0, "pass@1": 50.0, "pass@4": 50.0}


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 60).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n),
                                                       st.integers(1, n))))
def test_pass_at_k_matches_exact_binomials(nck: tuple[int, int, int]) -> None:
    n, c, k = nck
    exact = 1 - math.comb(n - c, k) / math.comb(n, k)
    assert pass_at_k(n, c, k) == pytest.approx(exact, abs=1e-9)
    if k < n:
        assert pass_at_k(n, c, k + 1) >= pass_at_k(n, c, k) - 1e-12  # monotone in k
