"""The group estimator (``algo.advantage_baseline: group``): a finished row with a finished
sibling takes its reward minus the siblings' mean on its window; the rest keep EGAE."""

import dataclasses

import jax.numpy as jnp
import numpy as np

from tppo_jax.config import load_config
from tppo_jax.learner import TrainBatch, compute_targets


def test_group_advantage_replaces_egae_on_finished_rows_with_siblings():
    cfg = load_config("smoke")
    b, s, w = 4, 12, 4
    batch = TrainBatch(
        tokens=jnp.ones((b, s), jnp.int32), attn=jnp.ones((b, s), bool),
        sample_logprobs=jnp.zeros((b, s)), prompt_len=jnp.full((b,), 2),
        window_start=jnp.full((b,), 2), window_len=jnp.array([3, 4, 4, 2]),
        finished=jnp.array([True, True, False, True]),
        reward=jnp.array([1.0, 0.0, 0.0, 1.0]),
        correct=jnp.array([True, False, False, True]),
        group=jnp.array([1, 1, 1, 2]))
    values = jnp.full((b, s), 0.25)
    out = {}
    for mode in ("critic", "group"):
        a = dataclasses.replace(cfg.algo, advantage_baseline=mode, whiten_advantages=False,
                                window_ignore_tokens=0)
        out[mode] = np.asarray(compute_targets(values, batch, a, w).advantages)
    g, c = out["group"], out["critic"]
    np.testing.assert_allclose(g[0, 2:5], 1.0)  # 1 - mean(0) of its finished sibling
    np.testing.assert_allclose(g[1, 2:6], -1.0)  # 0 - 1
    np.testing.assert_allclose(g[2], c[2])  # unfinished: EGAE
    np.testing.assert_allclose(g[3], c[3])  # no sibling: EGAE
    assert not np.allclose(g[0], c[0])


def test_rloo_is_critic_free_and_trains_finished_rows_whole_responses():
    """``rloo`` (needs no critic): a finished row with a finished sibling takes its reward
    minus the siblings' mean on its *whole* response (earlier windows included: they waited
    for the outcome), the values are never read, an unfinished row trains nothing."""
    from tppo_jax.learner.estimators import ESTIMATORS, needs_critic

    cfg = load_config("smoke")
    b, s, w = 4, 12, 4
    # Rows 0-1 started their responses at 2 and are in their second window (start 6)
    batch = TrainBatch(
        tokens=jnp.ones((b, s), jnp.int32), attn=jnp.ones((b, s), bool),
        sample_logprobs=jnp.zeros((b, s)), prompt_len=jnp.full((b,), 2),
        window_start=jnp.array([6, 6, 2, 2]), window_len=jnp.array([3, 4, 4, 2]),
        finished=jnp.array([True, True, False, True]),
        reward=jnp.array([1.0, 0.0, 0.0, 1.0]),
        correct=jnp.array([True, False, False, True]),
        group=jnp.array([1, 1, 1, 2]))
    a = dataclasses.replace(cfg.algo, advantage_baseline="rloo", whiten_advantages=False)
    assert not needs_critic(a) and not ESTIMATORS["rloo"].needs_critic
    assert needs_critic(cfg.algo)
    assert needs_critic(dataclasses.replace(a, advantage_baseline="group"))
    out = compute_targets(jnp.zeros((b, s)), batch, a, w)
    adv, pm = np.asarray(out.advantages), np.asarray(out.policy_mask)
    np.testing.assert_allclose(adv[0], [0, 0] + [1.0] * 7 + [0] * 3)  # tokens 2..8
    np.testing.assert_allclose(adv[1], [0, 0] + [-1.0] * 8 + [0] * 2)  # tokens 2..9
    np.testing.assert_allclose(pm[0], [0, 0] + [1] * 7 + [0] * 3)
    assert not pm[2].any() and not adv[2].any()  # unfinished: waits for its outcome
    assert pm[3].sum() == 2 and not adv[3].any()  # no finished sibling: no signal
    # The values are never read
    other = compute_targets(jnp.full((b, s), 3.0), batch, a, w)
    np.testing.assert_array_equal(np.asarray(other.advantages), adv)
