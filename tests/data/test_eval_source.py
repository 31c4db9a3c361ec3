"""``data.eval_source``: a separate held-out file; and a file too small to hold out
``data.eval_size`` rows is refused in one line that names both fixes."""

import json

import pytest

from tppo_jax.config import ConfigError, load_config
from tppo_jax.data.run_data import load_data


def _jsonl(path, n, start=0):
    path.write_text("".join(json.dumps({"question": f"What is {i}+1?", "answer": str(i + 1)})
                            + "\n" for i in range(start, start + n)))
    return str(path)


def test_small_file_is_one_line_with_the_fix(tmp_path):
    cfg = load_config(None, [f"data.source={_jsonl(tmp_path / 'five.jsonl', 5)}"])
    with pytest.raises(ConfigError) as e:
        load_data(cfg)
    msg = str(e.value)
    assert "has 5 rows" in msg and "data.eval_size=1 " in msg and "data.eval_source=" in msg
    assert "\n" not in msg


def test_eval_source_is_the_held_out_set(tmp_path):
    train = _jsonl(tmp_path / "train.jsonl", 5)
    held = _jsonl(tmp_path / "held.jsonl", 4, start=100)
    cfg = load_config(None, [f"data.source={train}", f"data.eval_source={held}",
                             "data.eval_size=3"])
    rows, evals = load_data(cfg)
    assert [r.answer for r in rows] == ["1", "2", "3", "4", "5"]  # every source row trains
    assert [r.answer for r in evals] == ["101", "102", "103"]  # the first eval_size rows


def test_an_empty_eval_source_says_it_is_empty(tmp_path):
    """Issue 62 L-10: it was reported as "every held-out prompt is longer than ..."."""
    train = _jsonl(tmp_path / "train.jsonl", 5)
    (tmp_path / "empty.jsonl").write_text("")
    cfg = load_config(None, [f"data.source={train}",
                             f"data.eval_source={tmp_path / 'empty.jsonl'}"])
    with pytest.raises(ConfigError) as e:
        load_data(cfg)
    msg = str(e.value)
    assert "empty.jsonl has no rows" in msg and "longer" not in msg and "\n" not in msg
