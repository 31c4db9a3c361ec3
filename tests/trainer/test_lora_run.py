"""A LoRA run end to end on the warm-started tiny model (``model.lora_rank > 0``): it decodes
and trains with the adapters, only the adapters change (the base, shared by the policy and the
critic, is bit-identical), the AdamW states cover the adapters alone, the KL reference is the
base with no second copy, checkpoints hold only what trains and restore it on a resume, and
``tppo export`` writes merged weights that give the run's logits."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from tppo_jax.config import load_config
from tppo_jax.models.lora import split_trainable
from tppo_jax.trainer.value_pretrain import pretrain_key
from tppo_jax.weights.params import VALUE_HEAD
from tppo_jax.weights.warmstart import warmstart_key

LORA = ["model.lora_rank=4", "model.lora_alpha=8"]
SMALL = ["train.warmstart_steps=20", "logging.tensorboard=false", "train.compile_cache=",
         "algo.kl_coef=0.1", "algo.critic_warmup_steps=0", *LORA]


def test_lora_settings_leave_the_warmstart_key_and_join_the_pretrain_key():
    base = load_config("smoke")
    lora = load_config("smoke", LORA)
    assert warmstart_key(lora) == warmstart_key(base)  # LoRA trains on top of the warm-start
    assert pretrain_key(lora) != pretrain_key(base)  # ... but its critic trains otherwise
    off = load_config("smoke", ["model.lora_alpha=8", "model.value_lora=false"])
    assert pretrain_key(off) == pretrain_key(base)  # rank 0: the LoRA keys change nothing


def _leaves(tree) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(tree))]


def _same(a, b) -> list[bool]:
    return [np.array_equal(x, y) for x, y in zip(_leaves(a), _leaves(b), strict=True)]


def _shapes(tree) -> list[tuple[str, tuple[int, ...]]]:
    """``(path, shape)`` of every leaf, sorted (keys as text: Orbax reads list indices back
    as strings)."""
    return sorted(("/".join(str(getattr(k, "key", k)) for k in path), tuple(x.shape))
                  for path, x in jax.tree_util.tree_leaves_with_path(tree))


def _saved(item: Path) -> list:
    """``_shapes`` of the tree an Orbax item folder holds (read from its metadata)."""
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as ckptr:
        return _shapes(ckptr.metadata(item).item_metadata.tree)


@pytest.mark.slow  # ~2-3 min on 2 shared cores: warm-start, two steps, a resume, an export
def test_lora_run_trains_only_adapters_and_checkpoints_and_exports_them(tmp_path):
    from tppo_jax.cli import main
    from tppo_jax.models.hf import from_pretrained
    from tppo_jax.trainer.trainer import Trainer, TrainHooks

    # A large step size (adapters start at B = 0 and move the policy slowly), and one
    # minibatch: the first step's KL is then all before any update
    cfg = load_config("smoke", [*SMALL, "train.steps=2", "optim.policy_lr=0.01",
                                "optim.minibatches=1", "optim.warmup_steps=0"])
    with Trainer(cfg, tmp_path / "r", progress=False) as run:
        state = run.state
        assert run.ref_policy is None  # the reference is the frozen base itself
        # AdamW's moments have the adapters' tree (the critic's: adapters + value head)
        for opt, train in ((state.policy_opt, split_trainable(state.policy)[0]),
                           (state.value_opt, split_trainable(state.value, VALUE_HEAD)[0])):
            for moment in ("mu", "nu"):
                assert _shapes(optax.tree.get(opt, moment)) == _shapes(train)
        assert state.value["backbone"]["embed"] is state.policy["backbone"]["embed"]
        start_p, start_v = jax.device_get(state.policy), jax.device_get(state.value)
        # A 20-step warm-start finishes no row: a constant advantage makes the policy move.
        push = TrainHooks(before_update=lambda _, t: t.replace(
            advantages=t.policy_mask.astype(jnp.float32)))
        kls = []
        for _ in range(2):
            upd = run.update(run.collect(), push)
            kls.append(float(upd.pstats["kl_ref"]))
        assert kls[0] < 1e-6 < kls[-1], kls  # ~0 at the base (fp noise); > 0 once moved
        run.checkpoint(last=True)
        state = run.state
        trained = jax.device_get(state.policy)
        tok = jnp.asarray(np.random.default_rng(0).integers(3, 100, (2, 24)), jnp.int32)
        want = np.asarray(run.policy_module()(tok))  # the run's model: base + adapters
    new_adapters, new_base = split_trainable(trained)
    assert all(_same(new_base, split_trainable(start_p)[1]))  # base bit-identical
    assert not all(_same(new_adapters, split_trainable(start_p)[0]))
    assert all(_same(split_trainable(state.value, VALUE_HEAD)[1],
                     split_trainable(start_v, VALUE_HEAD)[1]))

    # The checkpoint holds what trains, not the base (that comes from the warm-start again)
    ckpt = tmp_path / "r" / "checkpoints" / "2"
    assert _saved(ckpt / "policy") == _shapes(new_adapters)
    assert _saved(ckpt / "value") == _shapes(split_trainable(start_v, VALUE_HEAD)[0])

    resumed = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=3))
    with Trainer(resumed, tmp_path / "r", resume=True, progress=False) as run:
        state = run.state
        assert run.start == 2
        assert all(_same(state.policy, trained))  # adapters restored onto the same base
        assert state.value["backbone"]["embed"] is state.policy["backbone"]["embed"]

    assert main(["export", str(tmp_path / "r"), str(tmp_path / "hf")]) == 0
    merged = from_pretrained(tmp_path / "hf")  # plain HF weights: adapters folded in
    np.testing.assert_allclose(np.asarray(merged(tok)), want, rtol=1e-4, atol=1e-4)
    adapter = tmp_path / "hf" / "adapter"  # and the adapters alone, in PEFT's layout
    assert {p.name for p in adapter.iterdir()} == {"adapter_config.json",
                                                   "adapter_model.safetensors"}
