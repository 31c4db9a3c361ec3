"""Issue 49 L5: resuming a finished run said nothing, re-ran both evals and overwrote
``summary.json``; ``--resume train.steps=4`` below the checkpoint's step 8 was accepted and
rewrote ``config.yaml`` with ``steps: 4``. Both are now refused in one line, nothing
rewritten."""

import pytest

from tppo_jax import cli
from tppo_jax.config import load_config
from tppo_jax.runs.run_config import run_config_text


@pytest.mark.parametrize(("steps", "needle"), [
    ([], "is finished at step 8 (train.steps=8); raise train.steps to continue"),
    (["train.steps=4"], "is at step 8, past train.steps=4; raise train.steps above 8"),
])
def test_resuming_a_finished_run_is_refused_and_rewrites_nothing(tmp_path, capsys, steps,
                                                                  needle):
    run = tmp_path / "run"
    (run / "checkpoints" / "8").mkdir(parents=True)
    (run / "config.yaml").write_text(run_config_text(load_config("smoke", ["train.steps=8"])))
    (run / "summary.json").write_text('{"steps": 8}\n')
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    rc = cli.main(["train", "--run-dir", str(run), "--resume", "--no-progress", *steps])
    err = capsys.readouterr().err.strip().splitlines()  # INFO lines, then the refusal
    assert rc == 2 and err[-1].startswith("tppo train: refused: ") and needle in err[-1], err
    assert not any("Traceback" in line for line in err)
    assert str(run) in err[-1]
    after = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file() and p.name != ".lock"}
    assert after == before


def test_raising_train_steps_is_not_refused(tmp_path):
    from tppo_jax.runs.run_claim import finished_problem
    from tppo_jax.runs.run_dir import resolve_run_dir

    (tmp_path / "checkpoints" / "8").mkdir(parents=True)
    finished_problem(resolve_run_dir(tmp_path), 12)
    finished_problem(resolve_run_dir(tmp_path / "new"), 4)  # no checkpoint: nothing done
