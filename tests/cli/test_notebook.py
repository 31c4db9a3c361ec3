"""notebooks/quickstart.ipynb: stored without outputs, and runs end to end on CPU (shortened)."""

import gc
import json
import os
import sys
from pathlib import Path

import nbformat
import pytest

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "quickstart.ipynb"


def test_notebook_is_stored_clean():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    assert nb.nbformat == 4
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code
    for c in code:
        assert c.outputs == [] and c.execution_count is None, c.source[:80]
    params = [c for c in code if "parameters" in c.metadata.get("tags", [])]
    assert len(params) == 1
    for name in ("RUN_DIR", "STEPS", "OVERRIDES",
                 "TPPO_NB_RUN_DIR", "TPPO_NB_STEPS", "TPPO_NB_OVERRIDES"):
        assert name in params[0].source


@pytest.mark.slow
def test_notebook_runs(tmp_path):
    from jupyter_client import KernelManager
    from jupyter_client.kernelspec import KernelSpecManager
    from nbclient import NotebookClient

    nb = nbformat.read(NOTEBOOK, as_version=4)
    # Appended to this in-memory copy only: proves which interpreter ran the kernel.
    nb.cells.append(nbformat.v4.new_code_cell("import sys\nprint(sys.executable)"))

    # A kernelspec pinned to this interpreter: a "python3" spec found on the Jupyter path
    # (e.g. in ~/.local) could launch another Python without tppo_jax.
    kernels = tmp_path / "kernels"
    (kernels / "tppo-test").mkdir(parents=True)
    (kernels / "tppo-test" / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "tppo-jax test", "language": "python"}))
    km = KernelManager(kernel_name="tppo-test",
                       kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(kernels)]))

    run = tmp_path / "runs" / "nb"
    # One CPU device (no 8-fake-device flag from conftest): compiles faster on 2 cores.
    xla = [f for f in os.environ.get("XLA_FLAGS", "").split()
           if not f.startswith("--xla_force_host_platform_device_count")]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": " ".join(xla),
           "TPPO_NB_RUN_DIR": str(run), "TPPO_NB_STEPS": "2",
           "TPPO_NB_OVERRIDES": "data.eval_size=16 train.eval_samples=1"}
    env.pop("MPLBACKEND", None)  # the notebook draws inline

    client = NotebookClient(nb, km=km, timeout=600,
                            resources={"metadata": {"path": str(tmp_path)}})
    client.execute(env=env)  # raises CellExecutionError on the first failing cell
    # Collected here, not in a later test of this worker: a kernel client's finalizer logs a
    # traitlets warning on stderr that would land in that test's captured output.
    del client
    gc.collect()

    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    stdout = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "held-out accuracy" in stdout
    assert stdout.rstrip().splitlines()[-1] == sys.executable
    assert any("image/png" in o.get("data", {}) for o in outputs)  # inline figure + the PNG

    rows = (run / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in rows] == [1, 2]
    png = run / "metrics_vs_step.png"
    assert png.exists() and png.stat().st_size > 1000
    assert list((run / "tensorboard").iterdir())
    # The warm-start cache lives next to the run dir, so a re-run of the notebook reuses it.
    assert len(list(run.parent.glob("warmstart-*/DONE"))) == 1


def test_notebook_text_matches_the_configs_and_installs_jax_tpu():
    import re

    from tppo_jax.config import load_config

    nb = nbformat.read(NOTEBOOK, as_version=4)
    text = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    m = re.search(r"\((\d+) warm-start and (\d+) T-PPO steps", text)
    assert m, "the notebook no longer names the default's step counts"
    default = load_config("default")
    assert (int(m.group(1)), int(m.group(2))) == (default.train.warmstart_steps,
                                                  default.train.steps)
    assert "tppo_jax.fit(" in "\n".join(c.source for c in nb.cells)
    assert 'load_config("quick"' in "\n".join(c.source for c in nb.cells)


def _install_helpers(tmp_path, monkeypatch, source: str) -> dict:
    """The install cell's definitions (everything before its first pip call), run from a
    folder that is not a checkout with ``TPPO_SOURCE`` set to ``source``."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    install = next(c.source for c in nb.cells if c.cell_type == "code" and "%pip" in c.source)
    assert 'TPPO_SOURCE = ""' in install.splitlines()[:10]  # one variable, at the top
    head = install.split("if importlib.util.find_spec", 1)[0]
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TPPO_REPO_URL", raising=False)
    ns: dict = {}
    exec(head.replace('TPPO_SOURCE = ""', f"TPPO_SOURCE = {source!r}", 1), ns)
    return ns


def test_the_install_cell_installs_the_source_it_is_given(tmp_path, monkeypatch):
    import tomllib

    for var in ("COLAB_TPU_ADDR", "TPU_NAME"):
        monkeypatch.delenv(var, raising=False)
    ns = _install_helpers(tmp_path, monkeypatch, "https://example.org/tppo-jax.git")
    if ns["on_tpu_runtime"]():
        pytest.skip("this machine looks like a TPU VM")
    assert ns["requirement"]() == "'tppo-jax @ git+https://example.org/tppo-jax.git'"
    ns = _install_helpers(tmp_path, monkeypatch, "dist/tppo_jax-0.1.0-py3-none-any.whl")
    monkeypatch.setenv("COLAB_TPU_ADDR", "10.0.0.2:8470")
    # On TPU: the package's [tpu] extra, which pins jax[tpu] to the project's jax.
    assert ns["requirement"]() == "'dist/tppo_jax-0.1.0-py3-none-any.whl[tpu]'"
    pyproject = tomllib.loads((NOTEBOOK.parents[1] / "pyproject.toml").read_text())
    (pin,) = pyproject["project"]["optional-dependencies"]["tpu"]
    assert pin.startswith("jax[tpu]==")


def test_the_install_cell_without_a_source_says_so_in_one_line(tmp_path, monkeypatch):
    ns = _install_helpers(tmp_path, monkeypatch, "")
    with pytest.raises(SystemExit) as e:
        ns["requirement"]()
    msg = str(e.value)
    assert "\n" not in msg and "TPPO_SOURCE" in msg and "not on PyPI" in msg
