"""Exact resume after `kill -9`, and SIGTERM preemption, on the real `tppo train` (subprocesses).

One uninterrupted run A; a run B that is SIGKILLed mid-run, resumed, SIGTERMed (it must
checkpoint and exit 0). B's run directory is then copied elsewhere and the original and
the shared warm-start cache deleted; the latest checkpoint of the copy gets flipped bytes;
a resume whose checkpoint write fails (the OS refuses to grow files: a full disk) stops
with one line; and the command the preemption printed (no config, no overrides) resumes
the copy to the end, without a warm-start. Every step must report the same rewards and
losses as A: config, data iterator, RNG, both optimizers, the scheduler's unfinished
sequences and their KV cache all come back from the run directory.
"""

import json
import os
import re
import resource
import shlex
import shutil
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


def _fill_disk():
    """In the child: no file may grow past 64 KiB (checkpoint shards are bigger; logs are
    smaller), so the first checkpoint write fails as on a full disk."""
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, resource.RLIM_INFINITY))


def _flip_policy(step_dir):
    shard = max((p for p in (step_dir / "policy").rglob("*") if p.is_file()),
                key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2:len(data) // 2 + 64] = bytes(b ^ 0xFF for b in
                                                      data[len(data) // 2:len(data) // 2 + 64])
    shard.write_bytes(bytes(data))
    return shard


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
    advice = re.search(r"Continue with: (tppo train .*--resume)", out).group(1)

    # Copy the run elsewhere; delete the original and every warm-start cache.
    c = tmp_path / "moved" / "c"
    shutil.copytree(b, c)
    shutil.rmtree(b)
    for cache in runs.glob("warmstart-*"):
        shutil.rmtree(cache)
    # Damage the latest checkpoint: the resume must say so and use the one before.
    shard = _flip_policy(c / "checkpoints" / str(last))
    argv = [sys.executable, "-m", "tppo_jax.cli",
            *shlex.split(advice.replace(str(b), str(c)))[1:]]
    assert "--config" not in argv and "--resume" in argv

    # A full disk at the first save: one line, exit 1, the previous checkpoint intact.
    full = subprocess.run(argv + ["--no-progress"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=900, preexec_fn=_fill_disk)
    assert full.returncode == 1, full.stderr[-3000:]
    rel = shard.relative_to(c / "checkpoints" / str(last)).as_posix()
    assert f"CHECKPOINT DAMAGED: step {last}: policy: {rel}: content differs" in full.stderr
    assert f"resumed from step {last - 1}" in full.stderr
    stop = full.stderr.strip().splitlines()[-1]
    assert stop.startswith(f"tppo train: stopped: could not write the checkpoint of step "
                           f"{last}") and f"step {last - 1} is intact" in stop, full.stderr[-3000:]
    assert (c / "checkpoints" / f"{last}.damaged").is_dir()
    assert not [p for p in (c / "checkpoints").iterdir() if p.name.startswith(f"{last}.orbax")]

    done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    for r in (full, done):  # the run's own warm-start, its own config
        assert "warm-start: using the run's own copy" in r.stderr
        assert "warm-start: training" not in r.stderr
        assert "resume: with the run's own config" in r.stderr
    assert not list(tmp_path.rglob("warmstart-*"))

    ra, rb = _rows(a), _rows(c)
    assert [r["step"] for r in rb] == [r["step"] for r in ra] == list(range(1, 7))
    for x, y in zip(ra, rb, strict=True):
        for k in SAME:
            assert x[k] == y[k], (x["step"], k, x[k], y[k])
        for k in CLOSE:
            assert x[k] == pytest.approx(y[k], rel=1e-4, abs=1e-6), (x["step"], k)
