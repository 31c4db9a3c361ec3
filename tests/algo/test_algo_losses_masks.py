"""Masks, whitening and losses: docs/algorithm.md sections 3, 4 and 7."""

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

from tppo_jax.algo import (
    aggregate,
    explained_variance,
    masked_clip,
    masked_whiten,
    nll_loss,
    policy_loss,
    policy_mask,
    positive_example_mask,
    response_mask,
    value_loss,
    value_mask,
    window_mask,
)

# Two rows of length 10: prompt 3 tokens; row 0: earlier window [3,5), current [5,9) finished;
# row 1: earlier window [3,5), current window [5,10) unfinished.
PROMPT = jnp.array([3, 3])
WSTART = jnp.array([5, 5])
WLEN = jnp.array([4, 5])
TOTAL = WSTART + WLEN
FIN = jnp.array([True, False])


def test_policy_mask_zero_on_prompt_and_earlier_windows():
    pm = policy_mask(10, WSTART, WLEN, FIN, ignore_last=2)
    np.testing.assert_array_equal(pm[0], [0, 0, 0, 0, 0, 1, 1, 1, 1, 0])
    # Unfinished: the last 2 tokens of the window are dropped.
    np.testing.assert_array_equal(pm[1], [0, 0, 0, 0, 0, 1, 1, 1, 0, 0])
    assert float((pm * (1 - window_mask(10, WSTART, WLEN))).sum()) == 0.0


def test_policy_mask_ignore_longer_than_window_gives_empty_row():
    pm = policy_mask(10, WSTART, WLEN, jnp.array([False, False]), ignore_last=8)
    assert float(pm.sum()) == 0.0


def test_value_mask_zero_on_unfinished_and_prompt():
    vm = value_mask(10, PROMPT, TOTAL, FIN)
    np.testing.assert_array_equal(vm[0], [0, 0, 0, 1, 1, 1, 1, 1, 1, 0])
    np.testing.assert_array_equal(vm[1], np.zeros(10))


def test_positive_example_mask():
    pos = positive_example_mask(10, PROMPT, TOTAL, jnp.array([True, True]),
                                jnp.array([True, False]))
    np.testing.assert_array_equal(pos[0], response_mask(10, PROMPT, TOTAL)[0])
    assert float(pos[1].sum()) == 0


def test_token_vs_sample_aggregation_spec_example():
    # Lengths 1 and 3, loss 1 on the first token and 0 elsewhere: 1/4 vs 1/2.
    loss = jnp.array([[1.0, 0, 0], [0, 0, 0]])
    mask = jnp.array([[1.0, 0, 0], [1, 1, 1]])
    assert float(aggregate(loss, mask, mode="token")) == pytest.approx(0.25)
    assert float(aggregate(loss, mask, mode="sample")) == pytest.approx(0.5)


def _pg_grad(logp, adv, **kw):
    f = lambda lp: policy_loss(lp, jnp.zeros((1, 1)), jnp.full((1, 1), adv),  # noqa: E731
                               jnp.ones((1, 1)), **kw)[0]
    return float(jax.grad(f)(jnp.full((1, 1), logp))[0, 0])


def test_clip_higher_gradients():
    # A > 0: gradient vanishes once rho > 1 + eps_high = 1.28, not at 1.2.
    assert _pg_grad(np.log(1.25), 1.0) != 0.0
    assert _pg_grad(np.log(1.30), 1.0) == 0.0
    # A < 0: gradient vanishes once rho < 1 - eps_low = 0.8.
    assert _pg_grad(np.log(0.85), -1.0) != 0.0
    assert _pg_grad(np.log(0.75), -1.0) == 0.0


def test_policy_loss_hand_values_and_dual_clip():
    logp_old = jnp.zeros((1, 3))
    logp = jnp.log(jnp.array([[1.0, 2.0, 50.0]]))
    adv = jnp.array([[1.0, 1.0, -1.0]])
    loss, stats = policy_loss(logp, logp_old, adv, jnp.ones((1, 3)), dual_clip_c=10.0)
    # token 0: -1; token 1: -min(2, 1.28) = -1.28; token 2: -min(-50, -1.28)=50 -> capped at 10.
    assert float(loss) == pytest.approx((-1 - 1.28 + 10) / 3, rel=1e-5)
    assert float(stats["dual_clip_frac"]) == pytest.approx(1 / 3)
    loss_nodual, _ = policy_loss(logp, logp_old, adv, jnp.ones((1, 3)), dual_clip_c=None)
    assert float(loss_nodual) == pytest.approx((-1 - 1.28 + 50) / 3, rel=1e-5)


def test_policy_loss_on_policy_gradient_is_minus_advantage():
    lp = jnp.log(jnp.array([[0.3, 0.5]]))
    adv = jnp.array([[2.0, -1.0]])
    g = jax.grad(lambda x: policy_loss(x, lp, adv, jnp.ones((1, 2)))[0])(lp)
    np.testing.assert_allclose(g, -adv / 2, rtol=1e-6)


def test_masked_tokens_do_not_contribute():
    lp = jnp.array([[0.0, 5.0]])
    adv = jnp.array([[1.0, 100.0]])
    mask = jnp.array([[1.0, 0.0]])
    loss, stats = policy_loss(lp, jnp.zeros((1, 2)), adv, mask)
    assert float(loss) == pytest.approx(-1.0)
    assert float(stats["approx_kl"]) == pytest.approx(0.0)


def test_value_loss_clipping_hand_values():
    v_old = jnp.array([[0.0, 0.0]])
    v = jnp.array([[1.0, -1.0]])
    g = jnp.array([[2.0, 0.0]])
    loss, _ = value_loss(v, v_old, g, jnp.ones((1, 2)), clip_low=0.5, clip_high=0.6)
    # tok0: max((1-2)^2, (0.6-2)^2) = 1.96; tok1: max(1, 0.25) = 1.
    assert float(loss) == pytest.approx(0.5 * (1.96 + 1.0) / 2, rel=1e-6)
    loss_nc, _ = value_loss(v, v_old, g, jnp.ones((1, 2)), clip_low=None, clip_high=None)
    assert float(loss_nc) == pytest.approx(0.5 * (1.0 + 1.0) / 2, rel=1e-6)


def test_value_loss_perfect_critic_explains_all_variance():
    g = jnp.array([[1.0, 0.0, 1.0]])
    loss, stats = value_loss(g, g, g, jnp.ones((1, 3)))
    assert float(loss) == 0.0
    assert float(explained_variance(g, g, jnp.ones((1, 3)))) == pytest.approx(1.0)
    # V = mean(G): no better than the mean; returns without spread: 0.
    assert float(explained_variance(jnp.full((1, 3), 2 / 3), g, jnp.ones((1, 3)))) == \
        pytest.approx(0.0, abs=1e-6)
    assert float(explained_variance(g, jnp.ones((1, 3)), jnp.ones((1, 3)))) == 0.0


def test_nll_zero_when_no_positive_examples():
    assert float(nll_loss(jnp.full((2, 3), -2.0), jnp.zeros((2, 3)))) == 0.0
    assert float(nll_loss(jnp.full((2, 3), -2.0), jnp.ones((2, 3)))) == pytest.approx(2.0)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(2, 40))
def test_whiten_over_mask(seed, n):
    rng = np.random.default_rng(seed)
    x = rng.normal(3.0, 5.0, size=(2, n)).astype(np.float32)
    mask = (rng.random((2, n)) < 0.7).astype(np.float32)
    mask[0, 0] = mask[0, 1] = 1
    w = np.asarray(masked_whiten(x, mask))
    sel = w[mask > 0]
    assert abs(sel.mean()) < 1e-4
    assert sel.std(ddof=1) == pytest.approx(1.0, rel=1e-3)
    assert np.all(w[mask == 0] == 0)
    # Values outside the mask don't move the statistics.
    x2 = np.where(mask > 0, x, 1e6)
    np.testing.assert_allclose(masked_whiten(x2, mask), w, atol=1e-5)


def test_masked_clip():
    out = masked_clip(jnp.array([[-20.0, 3.0, 20.0]]), jnp.array([[1.0, 1.0, 0.0]]))
    np.testing.assert_array_equal(out, [[-10, 3, 0]])


def test_losses_under_jit():
    rng = np.random.default_rng(0)
    lp, lpo, adv = rng.normal(size=(3, 4, 7)).astype(np.float32) * 0.1
    m = (rng.random((4, 7)) < 0.8).astype(np.float32)
    f = jax.jit(lambda *a: policy_loss(*a)[0])
    assert float(f(lp, lpo, adv, m)) == pytest.approx(float(policy_loss(lp, lpo, adv, m)[0]),
                                                     rel=1e-5)


def test_aggregates_over_parts_add_up_with_the_whole_denominator():
    """Split a batch's rows into parts: with the whole batch's count as ``denom`` the parts'
    losses sum to the whole's (what lets a minibatch run as row groups of different widths)."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(6, 5)), jnp.float32)
    m = jnp.asarray(rng.random((6, 5)) < 0.6, jnp.float32).at[2].set(0.0)
    parts = (slice(0, 2), slice(2, 5), slice(5, 6))
    for mode, denom in (("token", m.sum()), ("sample", (m.sum(1) > 0).sum())):
        whole = aggregate(x, m, mode=mode)
        summed = sum(aggregate(x[p], m[p], mode=mode, denom=denom) for p in parts)
        assert float(summed) == pytest.approx(float(whole), rel=1e-6)
    # Hand value, token mode: two rows, 3 masked tokens in all; part 1 holds one of them.
    assert float(aggregate(jnp.array([[6.0, 1.0]]), jnp.array([[1.0, 0.0]]),
                           denom=jnp.array(3.0))) == 2.0
