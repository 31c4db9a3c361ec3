"""Issue 49 M1: ``tppo eval`` / ``export`` / ``serve`` on a run with no usable checkpoint
refuse in one line instead of using the untrained starting policy as "step 0"; ``--start``
asks for the starting policy explicitly."""

import os
import shutil
from pathlib import Path

import pytest

from tppo_jax.cli import main
from tppo_jax.config import load_config
from tppo_jax.data.synthetic import SyntheticMathTask
from tppo_jax.models.tokenizer import train_sentencepiece

FIXTURE = Path(__file__).parents[1] / "fixtures" / "hf" / "qwen2"


def _argv(command, run, tmp_path):
    return {"eval": ["eval", str(run)], "export": ["export", str(run), str(tmp_path / "out")],
            "serve": ["serve", "--checkpoint", str(run), "--port", "0"]}[command]


def _run(tmp_path, overrides=()):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(load_config("smoke", list(overrides)).to_yaml())
    return run


@pytest.mark.parametrize("command", ["eval", "export", "serve"])
@pytest.mark.parametrize("case", ["none", "damaged", "relative"])
def test_no_usable_checkpoint_is_refused_in_one_line(tmp_path, capsys, monkeypatch,
                                                     command, case):
    over = ["checkpoint.dir=ckpts"] if case == "relative" else []
    run = _run(tmp_path, over)
    if case == "damaged":  # both checkpoints set aside by an earlier resume
        for name in ("8.damaged", "10.damaged"):
            (run / "checkpoints" / name).mkdir(parents=True)
    if case == "relative":  # the run wrote them from tmp_path; read from elsewhere
        (tmp_path / "ckpts" / "8").mkdir(parents=True)
        monkeypatch.chdir(run)
    assert main(_argv(command, run, tmp_path)) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and f"{run} has no usable checkpoint: " in lines[0], err
    assert "--start" in lines[0] and "step 0" not in out
    if case == "damaged":
        assert "8.damaged" in lines[0] and "10.damaged" in lines[0]
    if case == "relative":
        assert "checkpoint.dir 'ckpts' is relative" in lines[0]
        assert not (run / "ckpts").exists()  # nothing created where it looked
    assert not (tmp_path / "out").exists()


def test_export_start_exports_the_starting_policy_when_asked(tmp_path, capsys):
    base = tmp_path / "base"
    shutil.copytree(FIXTURE, base)
    train_sentencepiece(SyntheticMathTask(seed=0).teacher_corpus(200, 0.0, 0.0),
                        base / "tokenizer", vocab_size=64)
    run = tmp_path / "run"
    run.mkdir()
    cfg = load_config(None, ["model.source=hf", f"model.path={base}", "model.max_seq_len=224"])
    (run / "config.yaml").write_text(cfg.to_yaml())
    assert main(["export", str(run), str(tmp_path / "out")]) == 2
    assert main(["export", str(run), str(tmp_path / "out"), "--start"]) == 0
    assert "exported the starting policy to" in capsys.readouterr().out
    # Issue 49 "Also": the weights are readable as the umask allows (safetensors wrote 0600).
    mask = os.umask(0o022)
    os.umask(mask)
    assert (tmp_path / "out" / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~mask
