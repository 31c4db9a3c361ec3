"""Exact resume after `kill -9`, and SIGTERM preemption, on the real `tppo train` (subprocesses).

One uninterrupted run A; a run B that is SIGKILLed mid-run, resumed, SIGTERMed (it must
checkpoint and exit 0), and resumed again to the end. Every step of B must report the
same rewards and losses as A: data iterator, RNG, both optimizers, the scheduler's
unfinished sequences and their KV cache all come back from the checkpoint.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

ARGS = ["--config", "smoke", "--no-progress", "train.steps=6", "checkpoint.every=1",
        "checkpoint.keep=10", "data.eval_size=8"]
SAME = ("reward_mean", "accuracy", "finished_frac", "tokens", "response_len_max")
CLOSE = ("policy_loss", "value_loss", "entropy", "approx_kl")


def _cmd(run_dir, *extra):
    return [sys.executable, "-m", "tppo_jax.cli", "train", *ARGS, "--run-dir", str(run_dir),
            *extra]


def _rows(run_dir):
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "reward_mean" in row:
            out.append(row)
    return out


def _wait_rows(proc, run_dir, n, timeout=400):
    t0 = time.monotonic()
    while len(_rows(run_dir)) < n:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() - t0 < timeout, "run made no progress"
        time.sleep(0.2)


@pytest.mark.slow
def test_kill9_resume_and_sigterm_match_uninterrupted(tmp_path):
    runs = tmp_path / "runs"
    a, b = runs / "a", runs / "b"
    done = subprocess.run(_cmd(a), cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]

    # B: SIGKILL once step 2 is logged (in the middle of step 3 or of its checkpoint).
    proc = subprocess.Popen(_cmd(b), cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        _wait_rows(proc, b, 2)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL

    # Resume, then SIGTERM: the run finishes its step, checkpoints and exits 0.
    proc = subprocess.Popen(_cmd(b, "--resume"), cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        _wait_rows(proc, b, 4)
        os.kill(proc.pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert "preempted" in out
    last = max(int(p.name) for p in (b / "checkpoints").iterdir() if p.name.isdigit())
    assert last == len(_rows(b)) >= 4

    done = subprocess.run(_cmd(b, "--resume"), cwd=tmp_path, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]

    ra, rb = _rows(a), _rows(b)
    assert [r["step"] for r in rb] == [r["step"] for r in ra] == list(range(1, 7))
    for x, y in zip(ra, rb, strict=True):
        for k in SAME:
            assert x[k] == y[k], (x["step"], k, x[k], y[k])
        for k in CLOSE:
            assert x[k] == pytest.approx(y[k], rel=1e-4, abs=1e-6), (x["step"], k)
