"""``sampling.sample_per_row``, the server's per-request sampler: each row's temperature and
top-p are traced values, log-probs are those of the distribution the row draws from, and a
row's token does not depend on what the other rows of the batch ask."""

import jax
import jax.numpy as jnp
import numpy as np

from tppo_jax.rollout.sampling import sample_per_row

LOGITS = jax.random.normal(jax.random.PRNGKey(0), (3, 40)) * 2.0
KEYS = jax.random.split(jax.random.PRNGKey(1), 3)
run = jax.jit(sample_per_row, static_argnames=("top_k", "n_top"))


def test_log_probs_are_of_the_tempered_truncated_distribution():
    t, p = jnp.array([0.5, 1.0, 0.0]), jnp.array([1.0, 0.5, 1.0])
    tok, lp, top_ids, top_lps = run(LOGITS, KEYS, t, p, n_top=40)
    want0 = jax.nn.log_softmax(LOGITS[0] / 0.5)
    np.testing.assert_allclose(lp[0], want0[tok[0]], rtol=1e-5)
    np.testing.assert_array_equal(top_ids[0], np.argsort(-np.asarray(LOGITS[0]), stable=True))
    kept = np.isfinite(np.asarray(top_lps[1]))  # the nucleus, renormalized
    full = np.asarray(jax.nn.softmax(LOGITS[1]))[np.asarray(top_ids[1])]
    assert kept.sum() == np.searchsorted(np.cumsum(full), 0.5) + 1
    np.testing.assert_allclose(np.exp(top_lps[1][kept]).sum(), 1.0, rtol=1e-5)
    assert int(tok[1]) in np.asarray(top_ids[1])[kept]
    assert int(tok[2]) == int(jnp.argmax(LOGITS[2]))  # temperature 0: greedy
    np.testing.assert_allclose(lp[2], jax.nn.log_softmax(LOGITS[2])[tok[2]], rtol=1e-5)


def test_a_row_samples_the_same_whatever_the_others_ask():
    t = jnp.ones(3)
    alone = run(LOGITS, KEYS, t, jnp.ones(3))[0]
    beside = run(LOGITS, KEYS, t, jnp.array([1.0, 1.0, 0.2]))[0]
    np.testing.assert_array_equal(alone[:2], beside[:2])
