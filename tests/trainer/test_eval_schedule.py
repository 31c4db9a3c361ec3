"""When the held-out eval runs: every N steps and/or every N seconds of training wall-clock."""

from tppo_jax.config import TrainConfig
from tppo_jax.trainer.trainer import eval_due


def test_eval_every_steps():
    tc = TrainConfig(eval_every=5)
    assert [s for s in range(1, 16) if eval_due(tc, s, 0.0, 0.0)] == [5, 10, 15]
    assert not any(eval_due(TrainConfig(), s, 1e6, 0.0) for s in range(1, 20))  # both off


def test_eval_every_seconds_of_training_wall_clock():
    tc = TrainConfig(eval_every_s=60.0)
    # Steps of 25 s: due at the first step at least 60 s after the last eval, then reset.
    last, due_at = 0.0, []
    for step in range(1, 10):
        t = 25.0 * step
        if eval_due(tc, step, t, last):
            due_at.append(step)
            last = t
    assert due_at == [3, 6, 9]
    both = TrainConfig(eval_every=2, eval_every_s=60.0)
    assert eval_due(both, 2, 10.0, 0.0) and eval_due(both, 3, 61.0, 0.0)
    assert not eval_due(both, 3, 59.0, 0.0)
