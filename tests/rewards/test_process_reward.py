"""Process rewards: placement per mode, and their real effect on GAE advantages."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tppo_jax.algo import gae
from tppo_jax.data.synthetic import SyntheticMathTask
from tppo_jax.models.tokenizer import Tokenizer, train_sentencepiece
from tppo_jax.rewards.process import process_rewards, step_token_ends
from tppo_jax.rewards.step_verifier import verify_solution

WRONG = "12 + 7 = 19\n19 * 2 = 36\n36 + 4 = 40\n\\boxed{40}"  # step 1 is wrong (38)
RIGHT = "12 + 7 = 19\n19 * 2 = 38\n38 + 4 = 42\n\\boxed{42}"


def test_modes_place_rewards_at_step_ends() -> None:
    reps = [verify_solution(WRONG), verify_solution(RIGHT)]
    ends = [[3, 8, 12, 15], [3, 8, 12, 15]]
    lens = [16, 16]
    none = process_rewards(reps, ends, lens, mode="none")
    assert none.shape == (2, 16) and not none.any()

    fe = process_rewards(reps, ends, lens, mode="first_error", penalty=-0.5)
    expect = np.zeros((2, 16), np.float32)
    expect[0, 8] = -0.5  # only the first invalid step, only in the wrong row
    np.testing.assert_array_equal(fe, expect)

    ps = process_rewards(reps, ends, lens, mode="per_step", penalty=-0.5, step_bonus=0.05)
    expect[0, [3, 12, 15]] = 0.05
    expect[1, [3, 8, 12, 15]] = 0.05
    np.testing.assert_allclose(ps, expect)


def test_truncated_steps_and_padding() -> None:
    reps = [verify_solution(WRONG)]
    # The response was cut at 8 tokens: the invalid step's end token (8) is not in the row.
    assert not process_rewards(reps, [[3, 8, 12, 15]], [8], mode="first_error").any()
    out = process_rewards(reps, [[3, 8, 12, 15]], [8], mode="per_step", num_tokens=20)
    assert out.shape == (1, 20) and out[0, 3] == pytest.approx(0.05) and out[0, 4:].sum() == 0
    # Two steps ending on one token accumulate.
    both = process_rewards(reps, [[5, 5, 9, 9]], [10], mode="per_step")
    assert both[0, 5] == pytest.approx(0.05 - 0.5) and both[0, 9] == pytest.approx(0.1)


def test_bad_arguments() -> None:
    rep = verify_solution(WRONG)
    with pytest.raises(ValueError, match="mode"):
        process_rewards([rep], [[1, 2, 3, 4]], [5], mode="sometimes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="batch mismatch"):
        process_rewards([rep], [], [5])
    with pytest.raises(ValueError, match="token ends for 4 steps"):
        process_rewards([rep], [[1, 2]], [5])


@pytest.mark.parametrize("lam", [1.0, 0.95, 0.5])
def test_first_error_lowers_advantages_before_the_error_only(lam: float) -> None:
    """With an outcome reward at the end and a penalty at token k, GAE changes exactly the
    advantages at t <= k, each by penalty * (gamma*lam)^(k-t); tokens after k are unchanged
    (the reward only enters delta_k, and A_t sums deltas from t on)."""
    b, t, k, gamma = 2, 24, 9, 0.99
    rng = np.random.default_rng(0)
    values = rng.normal(size=(b, t)).astype(np.float32)
    lens = np.array([24, 18])
    mask = (np.arange(t)[None] < lens[:, None]).astype(np.float32)
    outcome = np.zeros((b, t), np.float32)
    outcome[np.arange(b), lens - 1] = 1.0
    rep = verify_solution(WRONG)
    ends = [[3, k, 14, 17], [3, k, 14, 17]]
    proc = process_rewards([rep, rep], ends, lens, mode="first_error", penalty=-0.5,
                           num_tokens=t)
    base = np.asarray(gae(outcome, values, mask, gamma=gamma, lam=lam))
    with_p = np.asarray(gae(outcome + proc, values, mask, gamma=gamma, lam=lam))
    diff = with_p - base
    expect = np.zeros((b, t))
    expect[:, : k + 1] = -0.5 * (gamma * lam) ** (k - np.arange(k + 1))
    np.testing.assert_allclose(diff, expect, atol=1e-5)
    assert (diff[:, : k + 1] < 0).all() and (diff[:, k + 1:] == 0).all()


def test_end_to_end_with_sentencepiece(tmp_path: Path) -> None:
    """verify -> token ends (real tokenizer) -> rewards land on the wrong line's last token."""
    task = SyntheticMathTask(seed=0)
    tok: Tokenizer = train_sentencepiece(task.teacher_corpus(300), tmp_path / "spm",
                                         vocab_size=128)
    ids = tok.encode(WRONG)
    text = tok.decode(ids)
    assert text == WRONG
    rep = verify_solution(text)
    ends = step_token_ends(rep, text, tok, ids)
    assert ends[-1] == len(ids) - 1 and ends == sorted(ends)
    bad_end = ends[rep.first_invalid or 0]
    assert tok.decode(ids[: bad_end + 1]).endswith("= 36")
    proc = process_rewards([rep], [ends], [len(ids)], mode="first_error")
    assert np.flatnonzero(proc[0]).tolist() == [bad_end]
