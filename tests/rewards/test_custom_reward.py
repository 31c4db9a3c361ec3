"""``reward.fn``: a user's reward function runs in the grading pool with its deadlines; a
reward that sleeps past the deadline, raises, or returns NaN / a non-number is a graded
failure with its reason logged, never a crash; a bad path is one line."""

import logging
import math

import numpy as np
import pytest

from tppo_jax.config_checks import ConfigError
from tppo_jax.data.formats import MathExample
from tppo_jax.rewards.custom import call_reward_fn, load_reward_fn
from tppo_jax.rewards.grader import MathGrader

MODULE = '''
import time

def reward(prompt, completion, row):
    if completion == "sleep":
        time.sleep(30)
    if completion == "raise":
        raise ValueError("bad completion")
    if completion == "nan":
        return float("nan")
    if completion == "text":
        return "one"
    if completion == "record":
        return {"reward": 0.5, "correct": True, "reason": "half credit"}
    return 1.0 if completion == row["answer"] and prompt == row["question"] else 0.25
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))  # workers inherit the parent's sys.path
    return "my_rewards:reward"


@pytest.mark.parametrize("workers", [1, 0])
def test_custom_reward_in_the_pool_with_deadlines(user_module, workers, caplog):
    texts = ["7", "3", "record", "raise", "nan", "text", "sleep", "7"]
    rows = [MathExample(id=str(i), question="What is 3+4?", answer="7")
            for i in range(len(texts))]
    if workers == 0:  # inline: no kill-based deadline, so no sleeper
        texts, rows = texts[:-2] + texts[-1:], rows[:-1]
    with MathGrader(num_workers=workers, item_timeout_s=1.0, batch_deadline_s=20.0,
                    reward_fn=user_module, error_reward=-1.0) as g:
        with caplog.at_level(logging.WARNING, logger="tppo_jax.rewards.grader"):
            res = g.grade(texts, [r.answer for r in rows], rows)
        want = {"7": ("ok", 1.0), "3": ("wrong", 0.25), "record": ("ok", 0.5),
                "raise": ("crash", -1.0), "nan": ("crash", -1.0), "text": ("crash", -1.0),
                "sleep": ("timeout", -1.0)}
        assert res.reasons == [want[t][0] for t in texts]
        np.testing.assert_allclose(res.rewards, [want[t][1] for t in texts])
        assert res.correct.tolist() == [want[t][0] == "ok" for t in texts]
        assert "failed" in caplog.text and "bad completion" in caplog.text
        # Still grading after the failures (a killed sleeper was replaced).
        again = g.grade(["7"], ["7"], rows[:1])
        assert again.reasons == ["ok"] and again.rewards.tolist() == [1.0]


def test_call_reward_fn_never_raises():
    assert call_reward_fn(lambda p, c, r: 1 / 0, "", "", {}, 1.0)[0] == "crash"
    reason, value, note = call_reward_fn(lambda p, c, r: math.inf, "", "", {}, 1.0)
    assert (reason, value) == ("crash", None) and "inf" in note
    assert call_reward_fn(lambda p, c, r: True, "", "", {}, 1.0)[0] == "crash"
    assert call_reward_fn(lambda p, c, r: 2, "", "", {}, 1.0) == ("ok", 2.0, None)


@pytest.mark.parametrize("path, words", [
    ("no_colon", "package.module:function"),
    ("not_a_module_xyz:f", "cannot import not_a_module_xyz:f: no module named"),
    ("math:not_there", "cannot import math:not_there: AttributeError"),
    ("math:pi", "not callable"),
])
def test_bad_paths_are_one_line(path, words):
    with pytest.raises(ConfigError) as e:
        load_reward_fn(path)
    assert words in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ConfigError):
        MathGrader(num_workers=0, reward_fn=path)
