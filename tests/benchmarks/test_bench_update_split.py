"""``tppo bench update-split`` on the smoke config: every piece timed with nothing compiled
while timed, the detached policy step reports the full step's loss, and its backward covers
fewer cells on T-PPO's continuations."""

import argparse

import pytest

from tppo_jax.benchmarks import update_split


@pytest.mark.slow
def test_update_split_smoke(tmp_path):
    p = argparse.ArgumentParser()
    update_split.add_args(p)
    # window 16 of L 64: after 3 windows T-PPO's slots hold continuations
    out = update_split.run(p.parse_args(["--config", "smoke", "--steps", "1", "--skip", "3",
                                         "--out", str(tmp_path), "--no-progress"]))
    assert (tmp_path / "update_split.json").exists()
    for name in ("tppo", "ppo"):
        s = out["methods"][name]
        assert s["compiles_while_timed"] == 0
        assert s["loss_rel_diff_max"] < 1e-4
        assert all(s["seconds_total"][k] > 0 for k in ("targets", "policy", "policy_detached"))
    c = out["methods"]["tppo"]["cells"]
    # the detached pass skips the prefix columns in the backward, but its width buckets can
    # round up past the full pass's (the policy at init decides the step's lengths), so no
    # order between them
    assert c["policy_backward_full"] == c["policy_forward_full"]
    assert c["policy_backward_detached"] > 0 and c["policy_forward_detached"] > 0
