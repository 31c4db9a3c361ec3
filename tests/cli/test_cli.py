"""`tppo --help` lists only commands that work: each one's --help runs, cheap ones run for real."""

import json
import re
import subprocess
import sys

import numpy as np
import pytest

from tppo_jax.benchmarks.intensity import schedule_occupancy


def _tppo(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "tppo_jax.cli", *args], capture_output=True,
                          text=True, timeout=300, cwd=cwd)


@pytest.mark.slow  # ~9 s in one process on 2 shared cores
def test_every_listed_command_has_working_help():
    r = _tppo("--help")
    assert r.returncode == 0
    block = r.stdout.split("positional arguments:")[1].split("options:")[0]
    names = re.findall(r"^    (\w[\w-]*)\s", block, flags=re.M)
    assert {"train", "eval", "serve", "bench", "plot", "config", "data", "launch"} <= set(names)
    for name in names:
        h = _tppo(name, "--help")
        assert h.returncode == 0, (name, h.stderr[-500:])


def test_schedule_occupancy_properties():
    rng = np.random.default_rng(0)
    lengths = np.minimum(rng.lognormal(4, 0.8, size=256).astype(int) + 1, 512)
    ppo = schedule_occupancy(lengths, 32, 512, 512)
    tppo = schedule_occupancy(lengths, 32, 64, 512)
    assert ppo["useful_tokens"] == tppo["useful_tokens"] == int(lengths.sum())
    assert 0 < ppo["occupancy"] < tppo["occupancy"] <= 1
    # One synchronous batch: useful / (B * longest).
    one = schedule_occupancy(np.array([1, 2, 3, 10]), 4, 10, 10)
    assert one["slot_steps"] == 40 and one["occupancy"] == 16 / 40


def test_bench_intensity_writes_results(tmp_path):
    r = _tppo("bench", "intensity", "--arch", "tiny", "--slots", "8", "--max-len", "64",
              "--window", "16", "--prompt-len", "16", "--samples", "256", "--out",
              str(tmp_path))
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads((tmp_path / "intensity.json").read_text())
    assert out["decode_step"]["flops"] > 0 and out["decode_step"]["bytes"] > 0
    assert out["tppo"]["occupancy"] > out["ppo"]["occupancy"]
