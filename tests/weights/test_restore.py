"""A run directory is self-contained: an HF run keeps its model config and tokenizer, so
its checkpoints are evaluated/exported/served after ``model.path`` is gone, and the newest
policy that verifies is the one loaded."""

import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from tppo_jax.config import load_config
from tppo_jax.data.synthetic import SyntheticMathTask
from tppo_jax.models.tokenizer import train_sentencepiece
from tppo_jax.runs.checkpoint import ITEMS, Checkpointer
from tppo_jax.weights.restore import policy_from_run
from tppo_jax.weights.start import load_models

FIXTURE = Path(__file__).parents[1] / "fixtures" / "hf" / "qwen2"


def _hf_run(tmp_path):
    base = tmp_path / "base"
    shutil.copytree(FIXTURE, base)
    train_sentencepiece(SyntheticMathTask(seed=0).teacher_corpus(200, 0.0, 0.0),
                        base / "tokenizer", vocab_size=64)
    cfg = load_config(None, ["model.source=hf", f"model.path={base}", "model.max_seq_len=224"])
    run = tmp_path / "runs" / "hf"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(cfg.to_yaml())
    _, params = load_models(cfg, run, progress=False)
    return base, run, params


def _save(run, step, policy):
    dummy = {"x": jnp.zeros(2)}
    trees = {k: dummy for k in ITEMS} | {"policy": policy}
    ck = Checkpointer(run / "checkpoints", every=1, keep=5)
    assert ck.save(step, trees, {"step": step})
    ck.close()


def test_hf_run_restores_without_model_path(tmp_path):
    base, run, params = _hf_run(tmp_path)
    assert (run / "model" / "config.json").exists() and (run / "model" / "tokenizer.model").exists()
    half = jax.tree.map(lambda x: x * 0.5, params.policy)
    third = jax.tree.map(lambda x: x / 3, params.policy)
    _save(run, 1, half)
    _save(run, 2, third)
    shutil.rmtree(base)  # the base model is gone; the run dir is all there is
    got = policy_from_run(run)
    tok, policy, step, tok_file = got.tokenizer, got.model, got.step, got.tokenizer_file
    assert step == 2 and tok_file == run / "model" / "tokenizer.model" and tok.vocab_size == 64
    got = jax.tree.leaves(jax.tree.map(np.asarray, _params(policy)))
    want = jax.tree.leaves(jax.tree.map(np.asarray, third))
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w)
    # Damage step 2's policy: the newest good one (step 1) is loaded instead.
    shard = max((p for p in (run / "checkpoints" / "2" / "policy").rglob("*") if p.is_file()),
                key=lambda p: p.stat().st_size)
    shard.write_bytes(shard.read_bytes()[:-10])
    got = policy_from_run(run)
    policy, step = got.model, got.step
    assert step == 1
    np.testing.assert_allclose(jax.tree.leaves(_params(policy))[0],
                               jax.tree.leaves(half)[0])


def _params(model):
    from flax import nnx

    return nnx.to_pure_dict(nnx.state(model))
