"""Issue 62/63's reward-function findings: a reward is checked in the dtype it is used in
(``reward.max_abs``), numpy scalars are numbers, ``correct`` must be a bool, a function that
fails on (nearly) every item stops the run in one line, and ``reward.fn`` is imported and
called once on a sample row in a child process before a run starts (one line when it is
missing, raises, or ends the process), from the working directory too."""

import math
import sys

import numpy as np
import pytest

from tppo_jax import cli
from tppo_jax.config import load_config
from tppo_jax.config_checks import ConfigError
from tppo_jax.data.formats import MathExample
from tppo_jax.rewards.custom import (
    RewardFnError,
    call_reward_fn,
    check_reward,
    check_reward_fn,
    load_reward_fn,
)
from tppo_jax.rewards.grader import MathGrader


def _call(out, max_abs=1e4):
    return call_reward_fn(lambda p, c, r: out, "", "", {}, 1.0, max_abs)


@pytest.mark.parametrize("value", [1e300, -1e30, 1e5])
def test_a_reward_beyond_max_abs_is_a_graded_failure(value):
    # M-1: 1e300 is finite in float64 but inf in float32 (NaN losses); 1e30 trains 2 steps.
    reason, reward, note = _call(value)
    assert (reason, reward) == ("crash", None) and "reward.max_abs=10000" in note
    assert load_config("smoke").reward.max_abs == 1e4
    with pytest.raises(ConfigError, match="reward.max_abs must be in"):
        load_config("smoke", ["reward.max_abs=1e30"])


def test_numpy_scalars_are_rewards_and_correct_must_be_a_bool():
    assert _call(np.float32(0.5)) == ("wrong", 0.5, None)  # L-7
    assert _call(np.int64(1)) == ("ok", 1.0, None)
    assert _call(np.bool_(True))[0] == "crash"
    # L-3: the string "false" is truthy; it was counted as correct.
    reason, _, note = _call({"reward": 0.0, "correct": "false"})
    assert reason == "crash" and "correct='false'" in note and "not true/false" in note
    assert _call({"reward": 1.0, "correct": np.bool_(False), "reason": "r"}) == (
        "wrong", 1.0, "r")


FAILING = '''
def reward(prompt, completion, row):
    if completion.startswith("bad"):
        return row["no_such_key"]
    return {"reward": 1.0, "reason": "matched " + completion}
'''


def test_a_function_failing_on_nearly_every_item_stops_in_one_line(tmp_path, monkeypatch):
    (tmp_path / "failing_rw.py").write_text(FAILING)
    monkeypatch.chdir(tmp_path)  # found in the working directory, as a script's module is
    rows = [MathExample(id=str(i), question="q", answer="1") for i in range(8)]
    with MathGrader(num_workers=0, reward_fn="failing_rw:reward") as g:
        res = g.grade(["bad"] * 3 + ["ok"] * 5, ["1"] * 8, rows)  # 3 of 8: graded, goes on
        assert res.reasons[:3] == ["crash"] * 3 and res.notes[3] == "matched ok"
        assert "KeyError" in res.notes[0]  # kept for samples.jsonl
        with pytest.raises(RewardFnError) as e:  # M-2
            g.grade(["bad"] * 8, ["1"] * 8, rows)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("reward.fn failing_rw:reward failed on 8 of 8")
    assert "raised KeyError: 'no_such_key'" in msg and "90%" in msg


def test_reward_fn_is_checked_on_a_sample_row_in_a_child(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "exits_rw.py").write_text("import os\nos._exit(0)\n")
    (tmp_path / "fails_rw.py").write_text(FAILING.replace("startswith(\"bad\")", "strip()"))
    (tmp_path / "good_rw.py").write_text(
        "def reward(prompt, completion, row):\n    return float(completion.endswith('}.'))\n")
    row = {"id": "a", "question": "q", "answer": "3"}
    # L-6: os._exit(0) at import ended `tppo train` with rc 0 and no message.
    with pytest.raises(ConfigError, match=r"ended the process \(exit code 0\)"):
        check_reward_fn("exits_rw:reward", row)
    with pytest.raises(ConfigError) as e:
        check_reward_fn("fails_rw:reward", row)
    assert "failed on a sample row" in str(e.value) and "KeyError" in str(e.value)
    assert check_reward_fn("good_rw:reward", row) == ("ok", 1.0, None)
    # `tppo config` checks it resolves: a missing module is one line, exit 2.
    rc = cli.main(["config", "--config", "smoke", "reward.fn=no_such_rw_module:f"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "no module named 'no_such_rw_module'" in err[0], err
    assert "working directory" in err[0]
    check_reward(load_config("smoke", ["reward.fn=good_rw:reward"]).reward)
    assert cli.main(["config", "--config", "smoke", "reward.fn=good_rw:reward"]) == 0


def test_a_module_failing_only_in_the_workers_is_one_line(tmp_path, monkeypatch, capfd):
    (tmp_path / "worker_only_rw.py").write_text(
        "import multiprocessing\n"
        "if multiprocessing.current_process().name != 'MainProcess':\n"
        "    raise ImportError('needs the main process')\n"
        "def reward(prompt, completion, row):\n    return 1.0\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as e:
        MathGrader(num_workers=2, reward_fn="worker_only_rw:reward", startup_timeout_s=60)
    assert "needs the main process" in str(e.value) and "in a grading worker" in str(e.value)
    assert "Traceback" not in capfd.readouterr().err  # was 9 tracebacks


def test_the_working_directory_is_searched_last():
    assert load_reward_fn("math:sqrt") is math.sqrt
    assert sys.path.count(".") == 0


def test_the_docs_example_matches_boxed_answers():
    """Issue 63: the documented ``endswith(row["answer"])`` never matched ``\\boxed{N}``."""
    from pathlib import Path

    text = (Path(__file__).parents[2] / "docs" / "data.md").read_text()
    code = "#" + text.split("# my_rewards.py", 1)[1].split("```", 1)[0]
    ns: dict = {}
    exec(code, ns)  # noqa: S102 -- the docs' own example
    row = {"id": "1", "question": "q", "answer": "42"}
    assert ns["exact"]("q", "so the answer is \\boxed{42}", row) == 1.0
    assert ns["exact"]("q", "\\boxed{41}", row) == 0.0
    assert ns["exact"]("q", "42", row)["reward"] == 0.0
