"""benchmarks/gpu.sh end to end on the CPU (TPPO_BACKEND=cpu, --arch tiny): it installs the
checkout into its own venv, runs from outside the source tree and writes the results JSON;
with TPPO_BENCH it runs another benchmark (T-PPO vs PPO) the same way."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TINY = ["--arch", "tiny", "--dtype", "float32", "--batch", "4", "--prompt-len", "8",
        "--new-tokens", "8", "--train-batch", "2", "--train-len", "32"]


def _check(res: dict) -> None:
    assert res["backend"] == "cpu" and res["versions"]["jax"]
    assert res["decode"]["tokens_per_s"] > 0 and res["decode"]["new_tokens"] == 8
    for k in ("train_policy", "train_value"):
        assert res[k]["tokens_per_s"] > 0 and 1.0 < res[k]["xla"]["flops_vs_6n"] < 2.5
    xla = res["decode"]["xla"]
    assert xla["donated"]["cache_writes_per_call"] == []
    assert xla["not_donated"]["cache_writes_per_call"]
    hf = res["hf_generate"]
    assert "skipped" in hf or hf.get("static", {}).get("tokens_per_s", 0) > 0


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    """The module's accelerator venv (gpu.sh creates it on first use): one venv, not one a
    test."""
    return tmp_path_factory.mktemp("accel") / "venv"


@pytest.mark.slow
def test_gpu_script_cpu_path(tmp_path, venv):
    env = dict(os.environ, PYTHON=sys.executable, TPPO_BACKEND="cpu",
               TPPO_ACCEL_VENV=str(venv))
    out = tmp_path / "results"
    proc = subprocess.run([str(REPO / "benchmarks" / "gpu.sh"), *TINY, "--no-hf",
                           "--out", str(out)], env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _check(json.loads((out / "accelerator_cpu.json").read_text()))
    # Any benchmark through the same installed venv: T-PPO vs PPO, two steps of the smoke
    # config (the command gpu.sh gives for the long tail, made small: held-out evals of 8
    # questions, one sample each).
    proc = subprocess.run([str(REPO / "benchmarks" / "gpu.sh"), "--config", "smoke",
                           "--seeds", "1", "--target", "100", "--max-steps", "2",
                           "--eval-every", "1", "--out", str(out),
                           "data.eval_size=8", "train.eval_samples=1"],
                          env=dict(env, TPPO_BENCH="tppo-vs-ppo", TPPO_BENCH_TIMEOUT="600"),
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((out / "tppo_vs_ppo_smoke.json").read_text())
    assert res["config"] == "smoke" and res["window"] == 16 and res["L"] == 64
    assert res["overrides"] == ["data.eval_size=8", "train.eval_samples=1"]
    for method in ("tppo", "ppo"):
        assert res["seeds"]["0"][method]["steps"] == 2, res["seeds"]["0"][method]
    assert res["seeds"]["0"]["speedup_ceiling"] >= 1.0


@pytest.mark.slow  # creates the venv when it runs first
def test_gpu_script_refuses_the_wrong_backend(venv):
    env = dict(os.environ, PYTHON=sys.executable, TPPO_ACCEL_VENV=str(venv))
    proc = subprocess.run([str(REPO / "benchmarks" / "gpu.sh")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "reports backend 'cpu', not 'gpu'" in proc.stderr


@pytest.mark.slow
def test_accelerator_bench_from_the_cli(tmp_path):
    # `python -m tppo_jax.cli` from the repository root: the checkout's tppo_jax must still
    # find tppo_jax.benchmarks.
    proc = subprocess.run([sys.executable, "-m", "tppo_jax.cli", "bench", "accelerator",
                           *TINY, "--no-hf", "--out", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _check(json.loads((tmp_path / "accelerator_cpu.json").read_text()))


def test_source_checkout_maps_the_shipped_folders():
    # No site-packages (-S), so no installed or editable tppo_jax: the checkout alone must
    # resolve tppo_jax.benchmarks / .configs (folders inside the package, linked from the
    # top-level benchmarks/ and configs/).
    code = ("import sys; sys.path.insert(0, sys.argv[1]); "
            "import tppo_jax.benchmarks.xla_cost as m, tppo_jax.configs as c; "
            "print(m.__file__); print(c.__path__[0])")
    proc = subprocess.run([sys.executable, "-S", "-c", code, str(REPO)], cwd="/",
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [str(REPO / "tppo_jax" / "benchmarks" / "xla_cost.py"),
                                   str(REPO / "tppo_jax" / "configs")]
    for name in ("benchmarks", "configs", "kernels"):
        assert (REPO / name).resolve() == REPO / "tppo_jax" / name


def test_every_package_of_the_checkout_ships():
    # pyproject lists the packages by hand: one left out (tppo_jax.cli once was) is missing
    # from every wheel and non-editable install, `tppo` included, while an editable checkout
    # still finds it.
    import tomllib

    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
                 ["packages"])
    found = {".".join(p.parent.relative_to(REPO).parts)
             for p in (REPO / "tppo_jax").rglob("__init__.py")}
    assert found <= listed, sorted(found - listed)
