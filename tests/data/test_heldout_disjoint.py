"""Issue 49 L7: held-out rows were not deduplicated against training rows (8 of 8 overlapped
in a test file), and when every held-out prompt was too long all were kept and evaluated
anyway. Now training rows whose question is held out are dropped (counted), and too-long
held-out prompts are dropped (counted; none left is a one-line error)."""

import json
import logging

import pytest

from tppo_jax.config import ConfigError, load_config
from tppo_jax.data.run_data import load_data, prompt_rows


def _source(tmp_path, questions):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"question": q, "answer": str(i)}) + "\n"
                            for i, q in enumerate(questions)))
    return path


def test_training_rows_that_are_held_out_are_dropped(tmp_path, caplog):
    qs = [f"what is {i} + 1?" for i in range(8)]
    path = _source(tmp_path, qs + ["what is 0 + 1?", "what is  1 + 1?"] + qs[2:4])
    cfg = load_config(None, [f"data.source={path}", "data.format=generic", "data.eval_size=4"])
    with caplog.at_level(logging.WARNING):
        train, held = load_data(cfg)
    held_q = {" ".join(e.question.split()) for e in held}
    assert len(held) == 4 and not any(" ".join(e.question.split()) in held_q for e in train)
    assert len(train) == 8 - 4  # "what is 0..3 + 1?" are held out (spacing aside)
    assert "dropped 4 training rows whose question is also held out" in caplog.text


class _CharTok:
    """One id per character: a prompt's length is its text's."""

    eos_ids = (1,)
    bos_id = pad_id = 0
    add_bos = False
    chat_template = None

    def encode(self, text, **_):
        return [2 + ord(c) % 50 for c in text]


def test_too_long_held_out_prompts_are_dropped_or_refused(tmp_path, caplog):
    short = [f"q{i}" for i in range(6)]
    long = ["x" * 400]
    path = _source(tmp_path, short + long + short[:1])
    over = [f"data.source={path}", "data.format=generic", "data.eval_size=2",
            "data.prompt_template='{question}'", "rollout.max_prompt_len=64"]
    with caplog.at_level(logging.WARNING):
        _, held, _ = prompt_rows(load_config(None, over), _CharTok())
    assert [e.question for e in held] == ["q0"]
    assert "dropped 1 of 2 held-out prompts longer" in caplog.text
    path = _source(tmp_path, short + long * 2)
    with pytest.raises(ConfigError, match="every held-out prompt is longer"):
        prompt_rows(load_config(None, [*over[1:], f"data.source={path}"]), _CharTok())
