"""Evaluation metrics: avg@k (mean correctness over k samples) and unbiased pass@k."""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike


def _as_correct_matrix(correct: ArrayLike) -> np.ndarray:
    c = np.asarray(correct)
    if c.ndim == 1:  # one question
        c = c[None, :]
    if c.ndim != 2 or c.shape[1] == 0:
        raise ValueError(f"expected correct of shape [N, k] with k >= 1, got {c.shape}")
    return c.astype(bool)


def avg_at_k(correct: ArrayLike) -> float:
    """avg@k in percent: mean correctness over the ``k`` samples of each of ``N`` questions.

    ``correct``: bool ``[N, k]``. All correct -> 100.0; half correct -> 50.0; N = 0 -> nan.
    """
    c = _as_correct_matrix(correct) if np.asarray(correct).size else None
    if c is None:
        return float("nan")
    return float(100.0 * c.mean())


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k estimator (Chen et al., 2021) for one question, as a probability.

    ``pass@k = 1 - C(n-c, k) / C(n, k) = 1 - prod_{i=n-c+1}^{n} (1 - k/i)``; the product form
    avoids the huge binomials. ``n`` samples drawn, ``c`` of them correct, ``k <= n``.
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:  # every size-k subset contains a correct sample
        return 1.0
    i = np.arange(n - c + 1, n + 1, dtype=np.float64)
    return float(1.0 - np.prod(1.0 - k / i))


def pass_at_k_batch(n: ArrayLike, c: ArrayLike, k: int) -> np.ndarray:
    """Vectorised :func:`pass_at_k` over questions: ``n`` (scalar or [N]) and ``c`` ([N])."""
    c_arr = np.asarray(c, dtype=np.int64).reshape(-1)
    n_arr = np.broadcast_to(np.asarray(n, dtype=np.int64), c_arr.shape)
    return np.array([pass_at_k(int(ni), int(ci), k) for ni, ci in zip(n_arr, c_arr, strict=True)],
                    dtype=np.float64)


def pass_at_k_from_correct(correct: ArrayLike, k: int) -> float:
    """Mean unbiased pass@k in percent from a bool ``[N, n]`` matrix of sample correctness."""
    m = _as_correct_matrix(correct)
    return float(100.0 * pass_at_k_batch(m.shape[1], m.sum(axis=1), k).mean())


def summarize(correct: ArrayLike, ks: tuple[int, ...] = (1, 8, 32)) -> dict[str, float]:
    """``avg@n`` plus ``pass@k`` (percent) for every ``k`` in ``ks`` that fits ``n``."""
    m = _as_correct_matrix(correct)
    n = m.shape[1]
    out = {f"avg@{n}": avg_at_k(m)}
    for k in ks:
        if k <= n:
            out[f"pass@{k}"] = pass_at_k_from_correct(m, k)
    return out


def standard_error(values: ArrayLike) -> float:
    """Standard error of a mean over questions, in the values' units: the sample standard
    deviation (``ddof=1``) over ``sqrt(N)``. On 0/1 scores (greedy correctness) this is the
    binomial ``sqrt(p (1 - p) / (N - 1))``; on per-question avg@n / pass@k it is the
    "over questions" error that papers' +- columns report. nan for fewer than 2 questions."""
    v = np.asarray(values, dtype=np.float64).reshape(-1)
    if v.size < 2:
        return float("nan")
    return float(np.std(v, ddof=1) / np.sqrt(v.size))


def pass_ks(n: int) -> tuple[int, ...]:
    """The k of a pass@k report for ``n`` samples: 1, 2, 4, ... below ``n``, then ``n``."""
    ks = [1 << i for i in range(max(n, 1).bit_length()) if 1 << i < n]
    return (*ks, n)


def score(correct: ArrayLike, ks: tuple[int, ...] | None = None,
          reasons: ArrayLike | None = None) -> dict[str, float]:
    """The eval's metrics from ``N`` questions' graded samples: what the held-out eval and
    ``tppo eval --benchmark`` both report, so the two never disagree on a definition.

    ``correct``: bool ``[N, n]``. Returns percent values: ``avg@n`` (mean correctness) and,
    for every ``k`` in ``ks`` (default :func:`pass_ks`), the unbiased ``pass@k`` (mean over
    questions of ``1 - C(n-c, k) / C(n, k)``), each with its ``_se`` (:func:`standard_error`
    over questions). With ``reasons`` (the grader's per-sample reason, ``[N, n]``) also the
    share of samples with no answer found (``no_answer``), a found but wrong answer
    (``wrong``) and a grading timeout or crash (``grade_error``): a model that stops
    formatting its answer is told apart from one that answers wrongly.
    """
    m = _as_correct_matrix(correct)
    n_q, n = m.shape
    c = m.sum(axis=1)
    out = {f"avg@{n}": avg_at_k(m), f"avg@{n}_se": 100.0 * standard_error(m.mean(axis=1))}
    for k in pass_ks(n) if ks is None else ks:
        per_q = pass_at_k_batch(np.full(n_q, n), c, k)
        out[f"pass@{k}"] = float(np.mean(per_q) * 100.0)
        out[f"pass@{k}_se"] = 100.0 * standard_error(per_q)
    if reasons is not None:
        r = np.asarray(reasons).reshape(m.shape)
        out["no_answer"] = _percent(r == "no_answer")
        out["wrong"] = _percent(r == "wrong")
        out["grade_error"] = _percent((r != "ok") & (r != "no_answer") & (r != "wrong"))
    return out


def _percent(mask: np.ndarray) -> float:
    return float(100.0 * mask.mean()) if mask.size else float("nan")
