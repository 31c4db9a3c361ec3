"""Sampling: greedy, top-k, top-p frequencies, log-prob convention, per-slot keys."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tppo_jax.rollout import sampling

sample_jit = jax.jit(sampling.sample)


def truncated_dist(logits: np.ndarray, temperature: float, top_p: float, top_k: int) -> np.ndarray:
    """Independent numpy model: softmax(l/T), keep top-k, renormalize, keep nucleus, renormalize."""
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-z, kind="stable")
    keep = np.zeros_like(p, bool)
    k = len(p) if top_k <= 0 else top_k
    keep[order[:k]] = True
    q = np.where(keep, p, 0.0)
    q /= q.sum()
    cum = 0.0
    nucleus = np.zeros_like(keep)
    for i in order[:k]:
        nucleus[i] = True
        cum += q[i]
        if cum >= top_p:
            break
    r = np.where(nucleus, q, 0.0)
    return r / r.sum()


LOGITS = np.array([2.0, 1.5, 1.0, 0.3, -0.5, -1.0, -3.0, 0.9], np.float32)


def test_greedy_and_temperature_zero_are_argmax():
    logits = jax.random.normal(jax.random.key(0), (16, 50))
    want = jnp.argmax(logits, -1)
    tok, lp = sample_jit(logits, jax.random.key(1), greedy=True)
    np.testing.assert_array_equal(tok, want)
    np.testing.assert_allclose(lp, jax.nn.log_softmax(logits)[jnp.arange(16), want], rtol=1e-6)
    tok0, _ = sample_jit(logits, jax.random.key(2), temperature=0.0)
    np.testing.assert_array_equal(tok0, want)
    tok1, _ = sample_jit(logits, jax.random.key(3), top_k=1, temperature=1.3)
    np.testing.assert_array_equal(tok1, want)


def test_per_slot_parameters():
    logits = jax.random.normal(jax.random.key(0), (4, 30)) * 3
    temp = jnp.array([0.0, 1.0, 0.5, 1.0])
    top_k = jnp.array([0, 1, 0, 0])
    greedy = jnp.array([False, False, False, True])
    tok, lp = sample_jit(logits, jax.random.key(5), temperature=temp, top_k=top_k, greedy=greedy)
    am = np.asarray(jnp.argmax(logits, -1))
    assert tok[0] == am[0] and tok[1] == am[1] and tok[3] == am[3]
    want = jax.nn.log_softmax(logits / jnp.array([1.0, 1.0, 0.5, 1.0])[:, None])
    np.testing.assert_allclose(lp, want[jnp.arange(4), tok], rtol=1e-5)


@pytest.mark.parametrize(
    "temperature,top_p,top_k,candidates",
    [
        (1.0, None, None, None),  # truncation statically off: no sort
        (1.0, 1.0, 0, None),  # truncation off at run time
        (1.0, 1.0, 3, None),
        (1.0, 0.7, 0, None),
        (0.7, 0.9, 5, None),
        (1.5, 0.5, 4, None),
        (1.0, 0.6, 0, 5),  # nucleus (3 tokens) fits in 5 candidates: exact
        (0.8, 0.95, 3, 4),
    ],
)
def test_empirical_frequencies_match_truncated_distribution(temperature, top_p, top_k, candidates):
    n = 20000
    logits = jnp.broadcast_to(jnp.asarray(LOGITS), (n, LOGITS.size))
    tok, lp = jax.jit(sampling.sample, static_argnames="candidates")(
        logits,
        jax.random.key(7),
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        candidates=candidates,
    )
    tok = np.asarray(tok)
    expected = truncated_dist(LOGITS, temperature, top_p or 1.0, top_k or 0)
    counts = np.bincount(tok, minlength=LOGITS.size)
    assert counts[expected == 0].sum() == 0, "sampled a token outside the truncated support"
    sup = expected > 0
    chi2 = (((counts[sup] - n * expected[sup]) ** 2) / (n * expected[sup])).sum()
    # df <= 7; P(chi2_7 > 30) ~ 1e-4.
    assert chi2 < 30, (chi2, counts, n * expected)
    # Log-probs are of the full temperature-scaled softmax, not the truncated one.
    full = jax.nn.log_softmax(jnp.asarray(LOGITS) / temperature)
    np.testing.assert_allclose(lp, full[tok], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_no_token_outside_nucleus(seed):
    b, v = 256, 40
    logits = np.asarray(jax.random.normal(jax.random.key(seed), (b, v)) * 2.5)
    top_p = np.asarray(jax.random.uniform(jax.random.key(seed + 100), (b,), minval=0.05))
    tok, _ = sample_jit(jnp.asarray(logits), jax.random.key(seed + 7), top_p=jnp.asarray(top_p))
    for i in range(b):
        allowed = truncated_dist(logits[i], 1.0, float(top_p[i]), 0) > 0
        assert allowed[int(tok[i])], (i, top_p[i])


def test_rng_forms_and_sequence_keys_independent_of_batch():
    from tppo_jax.rollout.decode import sequence_keys

    logits = jax.random.normal(jax.random.key(0), (3, 100))
    keys = sequence_keys(jax.random.key(42), jnp.full(3, 5), jnp.array([10, 11, 12]))
    tok_all, _ = sample_jit(logits, keys)
    tok_one, _ = sample_jit(logits[2:], keys[2:])
    assert int(tok_all[2]) == int(tok_one[0])
    # A raw uint32 key and a single typed key are both accepted.
    t_raw, _ = sample_jit(logits, jax.random.PRNGKey(0))
    t_typed, _ = sample_jit(logits, jax.random.key(0))
    assert t_raw.shape == t_typed.shape == (3,) and t_raw.dtype == jnp.int32
    # Different token indices give different draws (overwhelmingly likely over 64 rows).
    flat = jnp.zeros((64, 100))
    a, _ = sample_jit(flat, sequence_keys(jax.random.key(1), jnp.zeros(64), jnp.arange(64)))
    b, _ = sample_jit(flat, sequence_keys(jax.random.key(1), jnp.ones(64), jnp.arange(64)))
    assert (np.asarray(a) != np.asarray(b)).any()


def test_truncation_mask_keeps_top_token_even_for_tiny_top_p():
    logits = jnp.asarray(LOGITS)[None]
    order, _, keep = sampling.truncation_mask(logits, top_p=1e-6, top_k=0)
    assert int(keep.sum()) == 1 and int(order[0, 0]) == int(jnp.argmax(logits))
