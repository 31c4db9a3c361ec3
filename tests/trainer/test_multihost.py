"""Multi-host on one machine: two CPU processes x 4 devices joined by ``jax.distributed``
(gloo collectives, coordinator on 127.0.0.1) run ``tppo train`` on the smoke config.

Checks: both exit 0; they end with identical params (full gathered digests); only process
0 wrote metrics; the per-host checkpoint state resumes with two processes to the params of
the uninterrupted run. Plus fast unit tests of the host <-> global helpers and the
start-up settings.
"""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from tppo_jax.parallel import multihost as mh
from tppo_jax.parallel.mesh import make_mesh

WORKER = Path(__file__).with_name("multihost_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_two(run_dir: Path, overrides: list[str], cwd: Path, flags: tuple = (),
             during=None, env: dict | None = None) -> list[str]:
    """Runs both processes to the end (``during(procs)`` is called once they started);
    returns their console output. Output goes to files: a full pipe would block one process
    while the other waits for it in a collective."""
    port = _free_port()
    # PYTHONPATH: the processes import this checkout's tppo_jax (a worktree's, not the
    # editable install's)
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
           "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
           **(env or {})}
    procs, logs = [], []
    try:
        for pid in range(2):
            args = [sys.executable, str(WORKER), "train", "--config", "smoke",
                    "--run-dir", str(run_dir), "--no-progress", *flags,
                    "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
                    "--process-id", str(pid),
                    "mesh.data=1", "mesh.fsdp=4", "mesh.tensor=2",
                    # wrong = -1: the smoke model rarely answers, and all-zero rewards
                    # would leave every loss (and so every param) unchanged.
                    "data.eval_size=8", "train.eval_samples=1", "algo.critic_warmup_steps=0",
                    "reward.wrong=-1",
                    # rollout weights resharded to the decode layout across both hosts
                    "mesh.decode_layout=decode", *overrides]
            log = (cwd / f"{run_dir.name}-process{pid}.log").open("w+")
            logs.append(log)
            procs.append(subprocess.Popen(args, cwd=cwd, env=env, stdout=log,
                                          stderr=subprocess.STDOUT, text=True))
        if during is not None:
            during(procs)
        for p in procs:
            p.wait(timeout=900)
    finally:  # never leave a process behind (one hung on the other's failure)
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    outs = []
    for log in logs:
        log.seek(0)
        outs.append(log.read())
        log.close()
    for pid, (p, out) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0, f"process {pid} exited {p.returncode}:\n{out[-4000:]}"
    return outs


def _digest(out: str, step: int | None = None) -> dict:
    """The worker's digest of checkpoint ``step`` (default: the final one, printed last)."""
    found = [json.loads(x[len("DIGEST "):]) for x in out.splitlines() if x.startswith("DIGEST ")]
    return found[-1] if step is None else next(d for d in found if d["step"] == step)


def _check_blocks(pages: dict, blocks: int) -> None:
    """A split paged pool as saved: each block's table rows name only its own pages (ids
    local to the block) and every page's refcount is the number of rows naming it."""
    table, ref = np.asarray(pages["table"]), np.asarray(pages["refcount"])
    per_slots, per_pages = len(table) // blocks, len(ref) // blocks
    assert (table < per_pages).all() and (table >= 0).any()
    for b in range(blocks):
        rows = table[b * per_slots:(b + 1) * per_slots]
        count = np.bincount(rows[rows >= 0], minlength=per_pages)
        np.testing.assert_array_equal(count, ref[b * per_pages:(b + 1) * per_pages])


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """The runs folder of the module's default-shape runs (dense cache, max_prompt_len 96):
    they share one warm-start cache, trained by the first, reused by the others. (The
    paged run's max_prompt_len=48 cuts the warm-start's corpus rows shorter: another
    warm-start, under its own key.)"""
    return tmp_path_factory.mktemp("mh-runs")


def _train_and_check(run: Path, kv: list[str], steps: int, cwd: Path) -> tuple[dict, dict]:
    """Two processes train ``steps`` steps uninterrupted (checkpoints at 2, by
    checkpoint.every, and at the last); the checks of the run. Returns the digests of the
    checkpoints of step 2 and of the last step."""
    paged = "rollout.kv_cache=paged" in kv
    outs = _run_two(run, [f"train.steps={steps}", *kv], cwd, env={"TPPO_TEST_DIGEST_ALL": "1"})
    d0, d1 = _digest(outs[0], step=2), _digest(outs[1], step=2)
    assert d0 == d1, (d0, d1)
    assert d0["step"] == 2 and d0["policy_finite"] and d0["value_finite"]
    last = _digest(outs[0])
    assert last == _digest(outs[1]) and last["step"] == steps
    # Paged: the pool is split into 4 blocks (one per batch shard: mesh.fsdp=4, two per host).
    assert ("kv_pages" in d0) == paged, d0["kv_leaves"]
    if paged:
        _check_blocks(d0["kv_pages"], 4)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))  # process 0 alone writes
    rows = rows[:2]
    # Both hosts' slots were trained on: 8 slots = 2 hosts x 4.
    assert all(r["tokens"] > 0 for r in rows)
    # The scheduler's counts are summed over hosts (dense: step 1 fills all 8 slots).
    assert all(r["sched_decode_slot_steps"] > 0 for r in rows)
    assert rows[0]["sched_admitted"] == 8 or paged
    if paged:
        assert all(0 < r["sched_pages_in_use"] <= r["sched_pages_total"] == 28 for r in rows)
        assert sum(r["sched_preempted"] for r in rows) > 0
    meta = json.loads((run / "checkpoints" / "2" / "meta" / "metadata").read_text())
    assert meta["num_processes"] == 2 and len(meta["hosts"]) == 2
    # Each host reads its own shard of the prompts: no question is in both hosts' slots.
    q = [{e["question"] for e in h["scheduler"]["examples"].values()} for h in meta["hosts"]]
    assert q[0] and q[1] and not q[0] & q[1]
    return d0, last


@pytest.mark.slow
def test_two_processes_train_and_agree_dense(runs, tmp_path):
    """Two steps. The two-process resume is the paged test's: the KV cache's save and
    restore are one code path for both caches (``checkpoint_items`` /
    ``restore_cache``), and the paged cache's adds the rows saved preempted."""
    _train_and_check(runs / "mh-dense", ["rollout.kv_cache=dense"], 2, tmp_path)


@pytest.mark.slow
def test_two_processes_train_resume_and_agree_paged(tmp_path):
    run = tmp_path / "runs" / "mh-paged"
    # 7 pages per block of 2 slots (one row at full length): rows are preempted and
    # re-prefilled, resumed with rows preempted when saved
    kv = ["rollout.kv_cache=paged", "rollout.max_prompt_len=48", "rollout.num_pages=28",
          "rollout.page_chunk=8"]
    d0, straight = _train_and_check(run, kv, 3, tmp_path)
    # Resume from step 2 with two processes (the step-3 checkpoint removed, as if the run
    # had stopped before writing it): each host takes back its own data, slots and KV
    # cache, so step 3 is exactly the uninterrupted run's step 3.
    shutil.rmtree(run / "checkpoints" / "3")
    first = (run / "metrics.jsonl").read_text().splitlines()
    outs = _run_two(run, ["train.steps=3", *kv], tmp_path, flags=("--resume",))
    r0, r1 = _digest(outs[0]), _digest(outs[1])
    assert r0 == r1 and r0["step"] == 3 and r0["policy"] != d0["policy"]
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2, 3]
    assert lines[:2] == first[:2] and lines[2] != first[2]  # step 3 logged again, once
    assert r0 == straight


@pytest.mark.slow
def test_sigterm_on_one_host_stops_both_at_the_same_step(runs, tmp_path):
    """Preemption reaches hosts at different times; a host leaving the loop alone would
    leave the other blocked in a collective. Here only process 1 gets SIGTERM."""
    run = runs / "pre"

    def preempt_process_1(procs):
        deadline = time.time() + 600
        metrics = run / "metrics.jsonl"
        while not (metrics.exists() and metrics.read_text().count("\n") >= 1):
            assert time.time() < deadline and all(p.poll() is None for p in procs)
            time.sleep(0.5)
        procs[1].send_signal(signal.SIGTERM)

    outs = _run_two(run, ["train.steps=12"], tmp_path, during=preempt_process_1)
    said = [re.search(r"preempted after step (\d+); checkpoint saved", o) for o in outs]
    assert all(said), outs[0][-2000:]
    step = int(said[0].group(1))
    assert int(said[1].group(1)) == step < 12
    assert _digest(outs[0]) == _digest(outs[1]) and _digest(outs[0])["step"] == step


# ---------------------------------------------------------------- single-process helpers
def test_host_global_roundtrip_single_process(devices8):
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    x = np.arange(8 * 3).reshape(8, 3).astype(np.float32)
    g = mh.host_to_global(x, mesh)
    assert g.shape == (8, 3) and g.sharding.spec[0] == ("data", "fsdp")
    back = mh.global_to_host(g)
    np.testing.assert_array_equal(back, x)
    back[0, 0] = -1.0  # host state restored from a checkpoint is modified in place
    np.testing.assert_array_equal(mh.global_to_host(jax.numpy.float32(3.0)), 3.0)
    assert mh.sum_over_hosts({"a": 2, "b": 1.5}) == {"a": 2.0, "b": 1.5}
    assert mh.max_over_hosts({"a": 2}) == {"a": 2.0}
    np.testing.assert_array_equal(mh.gather_rows(x[:2]), x[:2])
    assert mh.gather_json({"k": [1]}) == [{"k": [1]}]
    assert mh.split_for_host(list(range(5))) == list(range(5))
    mh.check_batch_layout(mesh, 8)  # trivially fine with one process


def test_initialize_needs_all_explicit_settings(monkeypatch):
    for k in (mh.ENV_COORDINATOR, mh.ENV_NUM_PROCESSES, mh.ENV_PROCESS_ID, mh.ENV_DISTRIBUTED):
        monkeypatch.delenv(k, raising=False)
    assert mh.initialize() is False  # nothing set: single process, nothing started
    with pytest.raises(ValueError, match="num_processes, process_id not set"):
        mh.initialize("127.0.0.1:1234")
    monkeypatch.setenv(mh.ENV_COORDINATOR, "127.0.0.1:1234")
    monkeypatch.setenv(mh.ENV_NUM_PROCESSES, "2")
    monkeypatch.setenv(mh.ENV_PROCESS_ID, "2")
    with pytest.raises(ValueError, match=r"process id 2 is not in \[0, 2\)"):
        mh.initialize()
    monkeypatch.setenv(mh.ENV_PROCESS_ID, "x")
    with pytest.raises(ValueError, match="TPPO_PROCESS_ID='x' is not an integer"):
        mh.initialize()


def test_cli_reports_bad_distributed_flags(tmp_path):
    r = subprocess.run([sys.executable, "-m", "tppo_jax.cli", "train", "--coordinator",
                        "127.0.0.1:1", "--num-processes", "2", "--run-dir", str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "config error: distributed: process_id not set" in r.stderr


def test_paged_cache_with_several_processes_needs_pages_per_shard():
    from tppo_jax.config import ConfigError, load_config, validate

    validate(load_config("smoke", ["rollout.kv_cache=paged"]), num_devices=8, num_processes=2)
    validate(load_config("smoke", []), num_devices=8, num_processes=2)
    base = ["rollout.kv_cache=paged", "mesh.data=1", "mesh.fsdp=4", "mesh.tensor=2"]
    with pytest.raises(ConfigError, match=r"num_pages \(402\) not divisible by the 4 decode"):
        validate(load_config("smoke", [*base, "rollout.num_pages=402"]), num_devices=8,
                 num_processes=2)
    with pytest.raises(ConfigError, match="leaves 2 pages per shard; .* window need 7"):
        validate(load_config("smoke", [*base, "rollout.num_pages=8", "rollout.page_alloc=window"]),
                 num_devices=8, num_processes=2)
    with pytest.raises(ConfigError, match="page_alloc=on_demand one row at full length"):
        validate(load_config("smoke", [*base, "rollout.num_pages=8"]), num_devices=8,
                 num_processes=2)


def test_resume_with_other_process_count_is_refused():
    from tppo_jax.config import ConfigError
    from tppo_jax.runs.checkpoint import host_meta

    meta = {"step": 4, "num_processes": 2, "hosts": [{"data_state": "a"}, {"data_state": "b"}]}
    with pytest.raises(ConfigError, match="written by 2 processes; this run has 1"):
        host_meta(meta)
    assert host_meta({**meta, "num_processes": 1, "hosts": [{"x": 1}]}) == {"x": 1}
