"""Every test runs with 8 fake CPU devices, so sharded paths are exercised on a laptop."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


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
