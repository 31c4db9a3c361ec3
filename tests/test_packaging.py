"""The package ships whole: a wheel built from the checkout holds the embedded configs, the
kernels, the benchmarks (with their shell scripts) and the shipped warm-starts, and `tppo
config` runs from it outside the checkout, a config's ``base:`` chain included, and finds the
default's warm-start inside the installed package."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # builds a wheel (pip fetches setuptools into an isolated build env)
def test_a_wheel_carries_configs_kernels_and_benchmarks(tmp_path: Path) -> None:
    out = tmp_path / "wheel"
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w",
                            str(out), str(REPO)], capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr[-3000:]
    (whl,) = out.glob("tppo_jax-*.whl")
    names = set(zipfile.ZipFile(whl).namelist())
    shipped = {p.name for p in (REPO / "tppo_jax" / "configs").glob("*.yaml")}
    assert {f"tppo_jax/configs/{n}" for n in shipped} <= names
    assert {"tppo_jax/kernels/__init__.py", "tppo_jax/benchmarks/xla_cost.py",
            "tppo_jax/benchmarks/gpu.sh", "tppo_jax/benchmarks/accelerator.sh"} <= names
    assert not [n for n in names if not n.startswith("tppo_jax")], "a top-level package ships"
    warm = REPO / "tppo_jax" / "warmstarts"
    files = {f"tppo_jax/{p.relative_to(warm.parent)}" for p in warm.rglob("*")
             if p.is_file() and "__pycache__" not in p.parts}
    assert files <= names, sorted(files - names)

    target = tmp_path / "site"
    inst = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                           "--target", str(target), str(whl)],
                          capture_output=True, text=True, timeout=300)
    assert inst.returncode == 0, inst.stderr[-3000:]
    env = dict(os.environ, PYTHONPATH=str(target))  # ahead of the editable checkout
    code = ("import tppo_jax, sys; from tppo_jax.cli import main; print(tppo_jax.__file__); "
            "from tppo_jax.config import load_config; "
            "from tppo_jax.weights.warmstart import shipped; "
            "print(shipped(load_config('default'))); "
            "sys.exit(main(['config', '--config', 'ppo']))")
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.splitlines()[0].startswith(str(target))
    if any(warm.glob("warmstart-*")):  # the default's, found inside the installed package
        assert run.stdout.splitlines()[1].startswith(str(target / "tppo_jax" / "warmstarts"))
    assert "window: 128" in run.stdout  # ppo.yaml's own key, over default.yaml's
