"""Training on an FSDP mesh while rollout and eval decode on tensor-parallel replicas
(``mesh.decode_tensor``): the policy is resharded after every update, and each step's
metrics say how long that took and how many bytes it copied."""

import json

import pytest

from tppo_jax.config import ConfigError, load_config
from tppo_jax.config_checks import validate
from tppo_jax.trainer.trainer import train

DECODE = ["mesh.data=1", "mesh.fsdp=8", "mesh.decode_layout=decode", "mesh.decode_tensor=2"]


@pytest.mark.slow
def test_smoke_trains_with_decode_replicas(tmp_path, devices8):
    cfg = load_config("smoke", [*DECODE, "train.steps=2", "data.eval_size=8",
                                "train.eval_samples=1"])
    summary = train(cfg, tmp_path / "run", progress=False)
    assert summary["steps"] == 2
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["reshard_s"] > 0 and r["reshard_gb"] > 0
        assert r["tokens"] > 0


@pytest.mark.parametrize("overrides, message", [
    (["mesh.decode_tensor=2"], "needs mesh.decode_layout=decode"),
    (["mesh.decode_layout=decode", "mesh.decode_tensor=3"], "does not divide the 8 devices"),
    (["mesh.data=1", "mesh.tensor=8", "mesh.decode_layout=decode", "mesh.decode_tensor=2",
      "rollout.prompts_per_step=1", "rollout.group_size=2"], "the 4 decode replicas"),
])
def test_decode_tensor_refusals(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(load_config("smoke", overrides), num_devices=8, num_processes=1)
