"""Every test runs with 8 fake CPU devices, so sharded paths are exercised on a laptop, and
with ``HOME`` in a temporary folder of the test run (one for the controller and its xdist
workers and subprocesses): the runs' default compile cache (``~/.cache/tppo-jax/xla``), and
any other cache a library keeps under the home directory, is shared by the run's tests and
never written to the user's home."""

import os
import shutil
import tempfile

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "TPPO_TEST_HOME" not in os.environ:  # the controller; xdist workers inherit both
    os.environ["TPPO_TEST_HOME"] = tempfile.mkdtemp(prefix="tppo-tests-home-")
os.environ["HOME"] = os.environ["TPPO_TEST_HOME"]

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


def pytest_unconfigure(config) -> None:
    if not hasattr(config, "workerinput"):  # the controller, after its workers are done
        shutil.rmtree(os.environ["TPPO_TEST_HOME"], ignore_errors=True)


def pytest_xdist_auto_num_workers(config) -> int:
    """``-n auto``: a worker per core, at most 4 (each holds its own JAX runtime and compile
    caches, ~1-2 GB; more workers on a big host only add memory)."""
    return max(1, min(os.cpu_count() or 1, 4))


@pytest.fixture(autouse=True)
def _root_logging_restored():
    """The root logger's handlers and level as before the test: a command run in-process
    (``tppo train`` sets up logging) must not change what a later test's stderr holds."""
    import logging

    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.fixture(scope="session")
def devices8():
    devs = jax.devices()
    assert len(devs) == 8, f"expected 8 fake CPU devices, got {len(devs)}"
    return devs


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    """An offline W&B directory of the test's own (``WANDB_MODE=offline``), and wandb's
    process-wide session torn down after, so no later test inherits its settings."""
    wandb_dir = tmp_path / "wandb_dir"
    wandb_dir.mkdir()
    for k, v in {"WANDB_MODE": "offline", "WANDB_DIR": str(wandb_dir), "WANDB_SILENT": "true",
                 "WANDB_CONSOLE": "off"}.items():
        monkeypatch.setenv(k, v)
    yield wandb_dir
    import wandb

    wandb.teardown()
