"""The fragility control's random move has the RL update's norm in every tensor, not its
direction."""

import jax
import jax.numpy as jnp
import numpy as np

from tppo_jax.benchmarks.greedy_fragility import same_size_random


def test_random_move_matches_each_tensor_norm():
    start = {"a": jnp.ones((4, 3)), "b": {"c": jnp.zeros(5)}, "d": jnp.ones(2)}
    moved = {"a": start["a"] + 0.1 * jnp.arange(12.0).reshape(4, 3),
             "b": {"c": jnp.full(5, -2.0)}, "d": start["d"]}  # "d" did not move
    out = same_size_random(start, moved, jax.random.key(0))
    for k in ("a", "d"):
        want = np.linalg.norm(np.asarray(moved[k] - start[k]))
        np.testing.assert_allclose(np.linalg.norm(np.asarray(out[k] - start[k])), want,
                                   rtol=1e-5, atol=1e-7)
    got = np.asarray(out["b"]["c"] - start["b"]["c"])
    np.testing.assert_allclose(np.linalg.norm(got), np.sqrt(20.0), rtol=1e-5)
    assert not np.allclose(got, -2.0)  # a random direction, not the update's
    other = same_size_random(start, moved, jax.random.key(1))
    assert not np.allclose(np.asarray(other["a"]), np.asarray(out["a"]))
