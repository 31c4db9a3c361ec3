"""GAE / EGAE / MC returns / length-adaptive lambda vs docs/algorithm.md numbers and properties."""

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

from tppo_jax.algo import (
    discounted_backward,
    effective_length,
    egae,
    gae,
    length_adaptive_lambda,
    mc_returns,
)

F, U = jnp.array([True]), jnp.array([False])


def row(*x):
    return jnp.array([x], jnp.float32)


@pytest.mark.parametrize("method", ["scan", "associative"])
def test_gae_worked_numbers(method):
    r, v, m = row(0, 0, 1), row(0.2, 0.4, 0.5), jnp.ones((1, 3))
    np.testing.assert_allclose(gae(r, v, m, lam=1.0, method=method), [[0.8, 0.6, 0.5]], atol=1e-6)
    np.testing.assert_allclose(
        gae(r, v, m, lam=0.95, method=method), [[0.74625, 0.575, 0.5]], atol=1e-6
    )


@pytest.mark.parametrize("method", ["scan", "associative"])
def test_egae_unfinished_worked_numbers(method):
    r, v, m = jnp.zeros((1, 4)), row(0.2, 0.4, 0.5, 0.6), jnp.ones((1, 4))
    np.testing.assert_allclose(
        egae(r, v, m, U, lam=1.0, method=method), [[0.4, 0.2, 0.1, 0.0]], atol=1e-6
    )
    np.testing.assert_allclose(
        egae(r, v, m, U, lam=0.5, method=method), [[0.275, 0.15, 0.1, 0.0]], atol=1e-6
    )


def test_egae_unfinished_gamma_lt_one_cut_delta():
    # delta_{l-1} = (gamma - 1) V(s_{l-1}) at the cut.
    v = row(0.0, 0.0, 0.5)
    a = egae(jnp.zeros((1, 3)), v, jnp.ones((1, 3)), U, gamma=0.9, lam=0.0)
    np.testing.assert_allclose(a[0, 2], (0.9 - 1.0) * 0.5, atol=1e-6)


def test_egae_padding_is_ignored_and_zero():
    r = jnp.array([[0, 0, 1, 7, 7], [0, 0, 0, 0, 1]], jnp.float32)
    v = jnp.array([[0.2, 0.4, 0.5, 9, 9], [0.1, 0.2, 0.3, 0.4, 0.5]], jnp.float32)
    m = jnp.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], jnp.float32)
    a = gae(r, v, m)
    np.testing.assert_allclose(a[0], [0.8, 0.6, 0.5, 0, 0], atol=1e-6)
    np.testing.assert_allclose(a[1], 1.0 - v[1], atol=1e-6)


def test_per_row_lambda():
    r = jnp.tile(row(0, 0, 1), (2, 1))
    v = jnp.tile(row(0.2, 0.4, 0.5), (2, 1))
    a = gae(r, v, jnp.ones((2, 3)), lam=jnp.array([1.0, 0.95]))
    np.testing.assert_allclose(a, [[0.8, 0.6, 0.5], [0.74625, 0.575, 0.5]], atol=1e-6)


def test_mc_returns():
    r = row(0, 0, 1)
    np.testing.assert_allclose(mc_returns(r, jnp.ones((1, 3))), [[1, 1, 1]])
    np.testing.assert_allclose(mc_returns(r, jnp.ones((1, 3)), gamma=0.5), [[0.25, 0.5, 1]])


def test_length_adaptive_lambda_worked_numbers():
    n = jnp.array([100, 400, 1000, 8192])
    np.testing.assert_allclose(
        length_adaptive_lambda(n, alpha=0.05, lam_min=0.0), [0.80, 0.95, 0.98, 0.9975586], atol=1e-6
    )
    # Default clamp at 0.95 (formula is <= 0 for n <= 20).
    lam = length_adaptive_lambda(jnp.array([5, 100, 1000]))
    np.testing.assert_allclose(lam, [0.95, 0.95, 0.98])


def test_effective_length_unfinished_adds_half_window():
    out = effective_length(jnp.array([100, 100]), jnp.array([True, False]), window=64)
    np.testing.assert_allclose(out, [100, 132])


# ---- properties -----------------------------------------------------------------------


@st.composite
def batches(draw):
    b = draw(st.integers(1, 5))
    t = draw(st.integers(1, 12))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, t + 1, size=b)
    mask = (np.arange(t)[None] < lengths[:, None]).astype(np.float32)
    rewards = rng.normal(size=(b, t)).astype(np.float32) * mask
    values = rng.normal(size=(b, t)).astype(np.float32)
    finished = rng.random(b) < 0.5
    gamma = float(draw(st.sampled_from([1.0, 0.99, 0.9])))
    lam = rng.uniform(0.0, 1.0, size=b).astype(np.float32)
    return rewards, values, mask, finished, gamma, lam


def reference_egae(r, v, m, fin, gamma, lam):
    """Plain-python loop, the definition."""
    out = np.zeros_like(r)
    for b in range(r.shape[0]):
        n = int(m[b].sum())
        boot = 0.0 if fin[b] else v[b, n - 1]
        acc = 0.0
        for t in reversed(range(n)):
            nv = v[b, t + 1] if t + 1 < n else boot
            delta = r[b, t] + gamma * nv - v[b, t]
            acc = delta + gamma * lam[b] * acc
            out[b, t] = acc
    return out


@settings(max_examples=40, deadline=None)
@given(batches())
@pytest.mark.slow  # ~16 s in one process on 2 shared cores
def test_egae_matches_python_definition_and_scans_agree(batch):
    r, v, m, fin, gamma, lam = batch
    ref = reference_egae(r, v, m, fin, gamma, lam)
    a_scan = egae(r, v, m, fin, gamma=gamma, lam=lam, method="scan")
    a_assoc = egae(r, v, m, fin, gamma=gamma, lam=lam, method="associative")
    np.testing.assert_allclose(a_scan, ref, atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(a_assoc, a_scan, atol=1e-4, rtol=1e-4)


@settings(max_examples=25, deadline=None)
@given(batches())
@pytest.mark.slow  # ~5 s in one process on 2 shared cores
def test_gae_lambda1_gamma1_is_return_minus_value(batch):
    r, v, m, _, _, _ = batch
    a = gae(r, v, m, gamma=1.0, lam=1.0)
    np.testing.assert_allclose(a, (mc_returns(r, m) - v) * m, atol=1e-4)


@settings(max_examples=25, deadline=None)
@given(batches(), st.integers(1, 11))
@pytest.mark.slow  # ~6 s in one process on 2 shared cores
def test_egae_finished_row_equals_gae_at_every_position(batch, cut):
    """EGAE on a finished sequence is exactly GAE; any window suffix of a finished
    sequence also equals the full-sequence GAE restricted to that window."""
    r, v, m, _, gamma, lam = batch
    fin = np.ones(r.shape[0], bool)
    np.testing.assert_allclose(egae(r, v, m, fin, gamma=gamma, lam=lam),
                               gae(r, v, m, gamma=gamma, lam=lam), atol=1e-6)
    # Suffix window [cut:] of a finished, fully-masked row.
    full_m = np.ones_like(m)
    if cut >= r.shape[1]:
        return
    whole = gae(r, v, full_m, gamma=gamma, lam=lam)
    tail = egae(r[:, cut:], v[:, cut:], full_m[:, cut:], fin, gamma=gamma, lam=lam)
    np.testing.assert_allclose(tail, whole[:, cut:], atol=1e-4, rtol=1e-4)


@pytest.mark.slow  # ~6 s in one process on 2 shared cores
def test_long_window_scans_agree():
    rng = np.random.default_rng(0)
    r = rng.normal(size=(2, 8192)).astype(np.float32) * 0.01
    v = rng.normal(size=(2, 8192)).astype(np.float32)
    m = np.ones_like(r)
    fin = np.array([True, False])
    a = egae(r, v, m, fin, gamma=1.0, lam=0.999, method="scan")
    b = egae(r, v, m, fin, gamma=1.0, lam=0.999, method="associative")
    np.testing.assert_allclose(a, b, atol=2e-3, rtol=1e-3)


def test_discounted_backward_rejects_unknown_method():
    with pytest.raises(ValueError, match="method"):
        discounted_backward(jnp.zeros((1, 2)), jnp.zeros((1, 2)), method="bogus")


def test_shape_errors_are_clear():
    with pytest.raises(ValueError, match="values"):
        egae(jnp.zeros((2, 3)), jnp.zeros((2, 4)), jnp.ones((2, 3)), jnp.ones(2, bool))
    with pytest.raises(ValueError, match="per-sequence"):
        gae(jnp.zeros((2, 3)), jnp.zeros((2, 3)), jnp.ones((2, 3)), lam=jnp.ones(3))


def test_jit_matches_eager():
    rng = np.random.default_rng(1)
    r, v = rng.normal(size=(2, 2, 6)).astype(np.float32)
    m = np.ones_like(r)
    fin = np.array([True, False])
    f = jax.jit(lambda r, v, m, f, lam: egae(r, v, m, f, gamma=1.0, lam=lam))
    np.testing.assert_allclose(f(r, v, m, fin, jnp.array([0.9, 0.95])),
                               egae(r, v, m, fin, lam=jnp.array([0.9, 0.95])), atol=1e-6)
