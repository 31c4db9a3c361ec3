"""One writer per run directory: ``tppo train`` holds an advisory lock on ``RUN/.lock`` for
the run's life (a second writer is refused in one line naming the holder; the OS drops
the lock when the holder dies), and a new run refuses a directory that holds another
run's logs instead of appending to them."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from tppo_jax import cli
from tppo_jax.config import load_config
from tppo_jax.runs.run_dir import LOCK, RunDirError, copy_tree, lock_run_dir
from tppo_jax.trainer.trainer import Trainer

HOLD = textwrap.dedent("""
    import sys, time
    from tppo_jax.runs.run_dir import lock_run_dir
    lock_run_dir(sys.argv[1])
    print("held", flush=True)
    time.sleep(600)
""")


@contextlib.contextmanager
def _holder(run):
    """Another process holding ``run``'s lock until the block ends (killed with -9)."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run)], stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        yield proc
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_a_second_writer_is_refused_naming_the_holder(tmp_path):
    run = tmp_path / "run"
    with _holder(run) as proc:
        with pytest.raises(RunDirError) as e:
            lock_run_dir(run)
        msg = str(e.value)
        assert "\n" not in msg and f"in use by another tppo train (pid {proc.pid} on " in msg
        info = json.loads((run / LOCK).read_text())
        assert info["pid"] == proc.pid and info["host"] and info["started"]
    # kill -9 of the holder released it (the OS drops a dead process's flock).
    release = lock_run_dir(run)
    assert json.loads((run / LOCK).read_text())["pid"] == os.getpid()
    release()


def test_a_lent_lock_lets_one_more_hold_in_and_is_released_by_the_last(tmp_path):
    run = tmp_path / "run"
    outer = lock_run_dir(run, lend=True)  # the CLI holds it, and the set-up takes it again
    inner = lock_run_dir(run)
    with pytest.raises(RunDirError, match="in use by another Trainer in this process"):
        lock_run_dir(run)  # a second set-up under the same command: refused
    inner()
    inner()  # a release called twice lets go of its own hold only
    code = f"from tppo_jax.runs.run_dir import lock_run_dir; lock_run_dir({str(run)!r})"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode != 0 and "in use by another tppo train" in r.stderr
    outer()
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr


def test_two_live_trainers_on_one_run_dir_in_one_process_are_refused(tmp_path):
    """H-1 (issue 62): a notebook cell run twice built two trainers on one run dir, both
    trained and saved step 9. The second is refused in one line; once the first is closed
    the run dir is free again."""
    from tppo_jax.runs.run_claim import claim_run_dir
    from tppo_jax.runs.run_dir import resolve_run_dir

    run = tmp_path / "run"
    first = claim_run_dir(resolve_run_dir(run), resume=True)  # what a live Trainer holds
    cfg = load_config("smoke", ["train.warmstart_steps=2", "train.compile_cache="])
    with pytest.raises(RunDirError) as e:
        Trainer(cfg, run, resume=True, progress=False)
    msg = str(e.value)
    assert "\n" not in msg and "in use by another Trainer in this process" in msg, msg
    assert "close the first" in msg
    first()
    claim_run_dir(resolve_run_dir(run), resume=True)()


def test_tppo_train_on_a_busy_run_dir_stops_in_one_line(tmp_path, capsys):
    run = tmp_path / "run"
    with _holder(run) as proc:
        rc = cli.main(["train", "--config", "smoke", "--run-dir", str(run), "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith("tppo train: refused: ") and f"pid {proc.pid}" in err[0]
    assert sorted(p.name for p in run.iterdir()) == [LOCK]  # nothing else written


def test_the_lock_is_not_mirrored_to_a_bucket(tmp_path):
    (tmp_path / "l").mkdir()
    (tmp_path / "l" / "metrics.jsonl").write_text("{}\n")
    release = lock_run_dir(tmp_path / "l")
    assert copy_tree(tmp_path / "l", tmp_path / "r") == 1
    assert not (tmp_path / "r" / LOCK).exists()
    release()


@pytest.mark.parametrize("log", ["metrics.jsonl", "samples.jsonl", "summary.json"])
def test_a_new_run_refuses_a_dir_with_another_runs_logs(tmp_path, log):
    run = tmp_path / "runs" / "old"
    run.mkdir(parents=True)
    (run / log).write_text('{"step": 1}\n{"step": 2}\n')
    before = (run / log).read_text()
    cfg = load_config("smoke", ["train.warmstart_steps=2", "logging.tensorboard=false",
                                "train.compile_cache="])
    with pytest.raises(RunDirError) as e:
        Trainer(cfg, run, progress=False)
    msg = str(e.value)
    assert "\n" not in msg and "holds another run's logs" in msg and log in msg
    assert "--resume" in msg and "--start-over" in msg and "new --run-dir" in msg
    assert (run / log).read_text() == before
    assert sorted(p.name for p in run.iterdir()) == sorted([LOCK, log])  # nothing else
    lock_run_dir(run)()  # and the refused set-up let go of the lock


def test_a_new_run_in_an_empty_or_fresh_dir_is_not_refused(tmp_path):
    from tppo_jax.runs.run_claim import start_problem
    from tppo_jax.runs.run_dir import resolve_run_dir

    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "metrics.jsonl").write_text("")  # an empty file is no run's log
    start_problem(resolve_run_dir(tmp_path / "a"), resume=False)
    start_problem(resolve_run_dir(tmp_path / "b"), resume=False)


def test_a_holder_killed_by_a_signal_leaves_no_lock(tmp_path):
    run = tmp_path / "run"
    with _holder(run) as proc:
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    lock_run_dir(run)()
