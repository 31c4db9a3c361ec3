"""The shape-only models the compile path builds (``weights.abstract.abstract_models``) are
the models a run builds (``weights.start.load_models``): the same trees, shapes, dtypes and
shardings, with LoRA adapters and a critic that shares the policy's frozen base."""

import json
import shutil
from pathlib import Path

import jax
import pytest

from tppo_jax.config import load_config
from tppo_jax.data.synthetic import SyntheticMathTask
from tppo_jax.models.hf import config_from_hf
from tppo_jax.models.tokenizer import train_sentencepiece
from tppo_jax.parallel.mesh import make_mesh
from tppo_jax.weights.abstract import abstract_models
from tppo_jax.weights.start import load_models

FIXTURE = Path(__file__).parents[1] / "fixtures" / "hf" / "qwen2"


def _described(tree):
    return jax.tree.map(lambda x: (x.shape, str(x.dtype), x.sharding.spec), tree)


@pytest.mark.slow  # ~9 s first in a process on 2 shared cores (the sharded load compiles)
@pytest.mark.parametrize("extra", [["model.lora_rank=4", "model.lora_alpha=8"],
                                   ["algo.advantage_baseline=group"]])
def test_abstract_models_are_the_run_models_shape_only(tmp_path, extra):
    base = tmp_path / "base"
    shutil.copytree(FIXTURE, base)
    train_sentencepiece(SyntheticMathTask(seed=0).teacher_corpus(200, 0.0, 0.0),
                        base / "tokenizer", vocab_size=64)
    cfg = load_config(None, ["model.source=hf", f"model.path={base}", "model.max_seq_len=224",
                             *extra])
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    models, params = load_models(cfg, run, progress=False, mesh=mesh)
    mc = config_from_hf(json.loads((base / "config.json").read_text()), cfg.model.dtype)
    got = abstract_models(cfg, mesh, mc)
    assert _described(got["policy"][1]) == _described(params.policy)
    if params.value is None:  # a critic-free estimator
        assert got["value"] == (None, None)
    else:
        assert _described(got["value"][1]) == _described(params.value)
