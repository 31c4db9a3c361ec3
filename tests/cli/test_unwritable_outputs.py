"""Issue 49 L1/L2: an output that cannot be written (a missing or read-only folder, a run
dir that cannot be made, a full disk) is refused in one line before any work, not a
traceback after it (``tppo eval`` computed the whole eval, then crashed writing its JSON)."""

import pytest

from tppo_jax import cli
from tppo_jax.config import load_config


def _run(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(load_config("smoke").to_yaml())
    return run


def test_eval_refuses_an_out_it_cannot_write_before_evaluating(tmp_path, capsys):
    run = _run(tmp_path)
    assert cli.main(["eval", str(run), "--start", "--out", "/nonexistent/x.json"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--out /nonexistent/x.json: folder /nonexistent does not exist" \
        in err[0], err
    assert not (run / "warmstart").exists()  # refused before the policy loaded


def test_export_refuses_an_out_under_a_file(tmp_path, capsys):
    run = _run(tmp_path)
    (tmp_path / "f").write_text("")
    assert cli.main(["export", str(run), str(tmp_path / "f" / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "export to" in err[0], err


def test_train_refuses_a_run_dir_it_cannot_make(tmp_path, capsys):
    (tmp_path / "f").write_text("")
    rc = cli.main(["train", "--config", "smoke", "--run-dir", str(tmp_path / "f" / "run"),
                   "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "cannot create the run dir" in err[0], err


def test_train_refuses_a_full_disk_before_any_work(tmp_path, capsys, monkeypatch):
    import shutil

    from tppo_jax.runs import run_claim

    free = shutil.disk_usage(tmp_path).free
    monkeypatch.setattr(run_claim, "MIN_FREE_BYTES", free + (1 << 40))  # more than is free
    rc = cli.main(["train", "--config", "smoke", "--run-dir", str(tmp_path / "run"),
                   "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "disk full under" in err[0], err
    assert not (tmp_path / "run" / "config.yaml").exists()


@pytest.fixture(autouse=True)
def _cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


FULL_DISK = """
import resource, signal, sys
from pathlib import Path
from tppo_jax.cli.runs import save_report
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
resource.setrlimit(resource.RLIMIT_FSIZE, (512, 512))
sys.exit(0 if save_report(Path(sys.argv[1]), {"accuracy": 61.5, "pad": "x" * 2000}) else 1)
"""


def test_eval_prints_its_result_before_a_write_that_fails(tmp_path):
    """Issue 62 L-11: on a full disk ``tppo eval`` lost the result of the whole eval (it
    wrote before it printed). Now printed first; the failed write is one line naming the
    file, and leaves no partial file."""
    import json
    import subprocess
    import sys

    out = tmp_path / "eval.json"
    r = subprocess.run([sys.executable, "-c", FULL_DISK, str(out)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 1, r.stderr
    assert r.stdout, r.stderr
    assert json.loads(r.stdout)["accuracy"] == 61.5
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and f"not saved: cannot write {out}: File too large" in err[0], err
    assert list(tmp_path.iterdir()) == []
