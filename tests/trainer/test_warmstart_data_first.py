"""Issue 49 L8: the tiny model's warm-start (trained on the synthetic task's teacher corpus
whatever the run's rows) was retrained for each data source, and ran before the data was
read, so a data source that cannot be read cost a full warm-start before its one-line
error. Now its key holds what it depends on, and the data is read first."""

import json

import pytest

from tppo_jax.config import load_config
from tppo_jax.data.readers import DataError
from tppo_jax.trainer.trainer import Trainer
from tppo_jax.weights.warmstart import warmstart_key


def test_the_warmstart_key_does_not_depend_on_the_data_source(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"question": "q", "answer": "1"}) + "\n")
    synthetic = load_config("smoke")
    table = load_config("smoke", [f"data.source={rows}", "data.format=generic",
                                  "data.eval_size=1"])
    assert warmstart_key(table) == warmstart_key(synthetic)
    # What the teacher corpus depends on still changes it.
    assert warmstart_key(load_config("smoke", ["data.max_steps=2"])) != warmstart_key(synthetic)


def test_unreadable_data_fails_before_the_warmstart(tmp_path):
    bad = tmp_path / "rows.jsonl"
    bad.write_text("{not json\n")
    cfg = load_config("smoke", [f"data.source={bad}", "data.format=generic",
                                "logging.tensorboard=false", "train.compile_cache="])
    run = tmp_path / "runs" / "r"
    with pytest.raises(DataError):
        Trainer(cfg, run, progress=False)
    assert not any(p.name.startswith("warmstart") for p in (tmp_path / "runs").iterdir())
    assert not (run / "warmstart").exists()
