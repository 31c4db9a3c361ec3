"""A full disk under the run dir: a metrics row is written whole or not at all (the file
keeps its earlier rows and parses), TensorBoard's writer failing never blocks or prints a
traceback, and ``tppo train`` stops with one line naming the cause and what is intact
(the last checkpoint verifies and restores)."""

import errno
import json
import logging
import os
import resource
import signal
import threading
from pathlib import Path

import jax.numpy as jnp
import pytest

from tppo_jax import cli
from tppo_jax.runs.checkpoint import ITEMS, Checkpointer
from tppo_jax.runs.metrics import MetricsWriter

ROW = {"reward_mean": 0.25, "policy_loss": -0.125, "note": "x" * 200}


def _steps(path: Path) -> list[int]:
    return [json.loads(x)["step"] for x in path.read_text().splitlines()]  # every line parses


@pytest.fixture
def enospc(monkeypatch):
    """``fail(name)``: from then on, writes to files called ``name`` write half of what they
    are given once, then fail with ENOSPC (what a disk that fills mid-row does)."""
    real, failing = os.write, set()

    def write(fd, data):
        name = os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
        if name not in failing:
            return real(fd, data)
        failing.discard(name)
        failing.add(f"{name} (written half)")
        return real(fd, bytes(data)[: max(1, len(data) // 2)])

    def write_or_fail(fd, data):
        name = os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
        if f"{name} (written half)" in failing:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return write(fd, data)

    monkeypatch.setattr(os, "write", write_or_fail)
    return failing.add


def test_a_row_cut_by_the_file_size_limit_is_not_left_half_written(tmp_path):
    m = MetricsWriter(tmp_path, tensorboard=False)
    for step in (1, 2, 3):
        m.write(step, ROW)
    size = (tmp_path / "metrics.jsonl").stat().st_size
    # The OS refuses to grow the file past 20 more bytes (a real short write, then EFBIG).
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size + 20, hard))
    try:
        with pytest.raises(OSError) as e:
            m.write(4, ROW)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old)
    assert e.value.errno == errno.EFBIG and e.value.filename == str(tmp_path / "metrics.jsonl")
    assert _steps(tmp_path / "metrics.jsonl") == [1, 2, 3]
    m.write(4, ROW)  # room again: the next row follows the last whole one
    assert _steps(tmp_path / "metrics.jsonl") == [1, 2, 3, 4]


def test_enospc_mid_row_keeps_metrics_and_samples_whole(tmp_path, enospc):
    m = MetricsWriter(tmp_path, tensorboard=False)
    m.write(1, ROW)
    m.write_samples(1, [{"prompt": "p", "completion": "c"}] * 3)
    enospc("metrics.jsonl")
    with pytest.raises(OSError) as e:
        m.write(2, ROW)
    assert e.value.errno == errno.ENOSPC and e.value.filename.endswith("metrics.jsonl")
    assert _steps(tmp_path / "metrics.jsonl") == [1]
    enospc("samples.jsonl")
    with pytest.raises(OSError):
        m.write_samples(2, [{"prompt": "p", "completion": "c"}] * 3)
    assert _steps(tmp_path / "samples.jsonl") == [1, 1, 1]


def test_a_dead_tensorboard_writer_neither_blocks_nor_prints_a_traceback(tmp_path, caplog,
                                                                         capfd):
    m = MetricsWriter(tmp_path, tensorboard=True)
    (writer,) = m.tb.all_writers.values()

    def full(event):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    writer.event_writer._ev_writer.write_event = full
    done = threading.Event()

    def steps():  # 40 rows x 3 scalars: far more than tensorboardX's default queue of 10
        for step in range(1, 41):
            m.write(step, {"a": 1.0, "b": 2.0, "c": 3.0})
        m.close()
        done.set()

    with caplog.at_level(logging.WARNING):
        threading.Thread(target=steps, daemon=True).start()
        assert done.wait(60), "a step blocked on TensorBoard's queue"
    assert _steps(tmp_path / "metrics.jsonl") == list(range(1, 41))
    assert caplog.text.count("tensorboard: its event writer stopped") == 1
    err = capfd.readouterr().err
    # the writer thread's death prints nothing (a "--- Logging error ---" from a handler an
    # earlier test left on a closed stream is not this test's business)
    assert "Exception in thread" not in err and "write_event" not in err and "ENOSPC" not in err


def _trees(x: float):
    return {k: {"w": jnp.full((8,), x)} for k in ITEMS}


def test_tppo_train_stops_in_one_line_with_the_checkpoint_intact(tmp_path, monkeypatch,
                                                                 enospc, capsys):
    run = tmp_path / "run"

    def train(cfg, run_dir, *, resume, progress, hooks):  # two steps, a save, a full disk
        ck = Checkpointer(Path(run_dir) / "checkpoints", every=1, keep=3)
        m = MetricsWriter(Path(run_dir), tensorboard=True)
        try:
            for step in (1, 2):
                m.write(step, ROW)
            assert ck.save(2, _trees(2.0), {"step": 2})
            enospc("metrics.jsonl")
            m.write(3, ROW)
        finally:
            m.close()
            ck.close()

    monkeypatch.setattr("tppo_jax.trainer.trainer.train", train)
    rc = cli.main(["train", "--config", "smoke", "--run-dir", str(run), "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1, err
    assert err[0] == (f"tppo train: stopped: disk full under {run}: No space left on device "
                      f"({run / 'metrics.jsonl'}); the last checkpoint (step 2) and "
                      f"metrics.jsonl are intact; free space, then --resume")
    assert _steps(run / "metrics.jsonl") == [1, 2]
    ck = Checkpointer(run / "checkpoints", every=1, keep=3)
    assert ck.verify(2) == []
    step, trees, meta = ck.restore_latest(_trees(0.0))
    assert step == 2 and float(trees["policy"]["w"][0]) == 2.0
    ck.close()


def test_an_oserror_elsewhere_is_not_reported_as_the_run_dir(tmp_path, monkeypatch):
    from tppo_jax.cli.train import run_files_error
    from tppo_jax.runs.run_dir import resolve_run_dir

    rd = resolve_run_dir(tmp_path / "run")
    assert run_files_error(OSError(errno.ENOENT, "No such file", "/etc/x"), rd) is None
    line = run_files_error(OSError(errno.EACCES, "Permission denied",
                                   str(tmp_path / "run" / "eval_before.json")), rd)
    assert line.startswith(f"cannot write under {tmp_path / 'run'}: Permission denied")
    assert "no checkpoint was written yet" in line
