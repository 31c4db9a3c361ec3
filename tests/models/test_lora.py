"""LoRA adapters (models/lora.py): a fresh adapter changes no logit, every forward (training,
prefill, decode) runs the adapters, merging folds them into the weights, adapters are placed
like their base on a mesh, and an update trains the adapters alone (base bit-identical, AdamW
states only for the adapters, the KL reference is the base without a copy)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from oracles import batch_and_targets, learner_with, update

from tppo_jax.config import AlgoConfig, ConfigError, OptimConfig, load_config
from tppo_jax.config_checks import LORA_TARGETS, parse_lora_targets
from tppo_jax.learner import LearnerConfig, RowPlan, TrainState, commit_to_mesh
from tppo_jax.models.hf import from_pretrained, save_peft_adapter, save_pretrained
from tppo_jax.models.lora import (
    LoraSpec,
    adapter_einsums,
    add_lora,
    join_params,
    lora_spec,
    merge_lora,
    split_trainable,
)
from tppo_jax.models.transformer import PROJECTIONS, ModelConfig, Transformer, shard_model
from tppo_jax.models.value import ValueModel
from tppo_jax.parallel.mesh import make_mesh
from tppo_jax.weights.params import VALUE_HEAD

ALL = LoraSpec(rank=4, alpha=8.0, targets=LORA_TARGETS)


def tiny(seed: int = 0) -> Transformer:
    return Transformer(ModelConfig.tiny(vocab_size=32, num_layers=2), rngs=nnx.Rngs(seed))


def tokens(b: int = 2, t: int = 12) -> jax.Array:
    return jax.random.randint(jax.random.key(7), (b, t), 0, 32)


def three_forwards(model: nnx.Module, tok: jax.Array) -> tuple[jax.Array, ...]:
    """``__call__``, ``hidden_states`` + head (the losses), ``forward_with_cache`` (decode)."""
    b, t = tok.shape
    pos = jnp.broadcast_to(jnp.arange(t)[None], (b, t))
    cached, _ = model.forward_with_cache(tok, pos, model.init_cache(b, 2 * t),
                                         valid=jnp.ones((b, t), bool))
    return model(tok), model.logits_from_hidden(model.hidden_states(tok)), cached


def moved(model: nnx.Module, by: float = 0.05) -> nnx.Module:
    """``model`` with every adapter param shifted (so ``B != 0``)."""
    graphdef, state = nnx.split(model)
    train, frozen = split_trainable(nnx.to_pure_dict(state))
    return nnx.merge(graphdef, join_params(jax.tree.map(lambda x: x + by, train), frozen))


def test_targets_are_the_model_projections_and_parse_in_order():
    assert set(LORA_TARGETS) == set(PROJECTIONS)
    assert parse_lora_targets(" v, q ,q") == ("q", "v")
    for bad, why in (("q,x", "unknown projection 'x'"), (" , ", "no projection named")):
        with pytest.raises(ConfigError, match=why):
            parse_lora_targets(bad)
    with pytest.raises(ConfigError, match="model.lora_targets"):
        load_config(None, ["model.lora_targets=qkv"])
    assert lora_spec(load_config(None).model) is None  # rank 0: off
    spec = lora_spec(load_config(None, ["model.lora_rank=8", "model.lora_targets=o,q"]).model)
    assert spec == LoraSpec(8, 16.0, ("q", "o")) and spec.scale == 2.0


def test_adapter_einsums_span_input_then_output_dims():
    q = adapter_einsums(PROJECTIONS["q"][1])  # bth,hnd->btnd
    assert (q.a, q.b, q.w) == ("bth,hr->btr", "btr,rnd->btnd", "hr,rnd->hnd")
    o = adapter_einsums(PROJECTIONS["o"][1])  # btnd,ndh->bth
    assert (o.a, o.b, o.w) == ("btnd,ndr->btr", "btr,rh->bth", "ndr,rh->ndh")


@pytest.mark.slow  # ~9 s in one process on 2 shared cores
def test_fresh_adapters_leave_every_forward_exactly_as_it_was():
    tok = tokens()
    base = tiny()
    want = three_forwards(base, tok)
    lora = add_lora(tiny(), ALL, seed=3)
    for got, ref in zip(three_forwards(lora, tok), want, strict=True):
        np.testing.assert_array_equal(got, ref)  # B = 0: bit for bit
    layers = lora.backbone.layers  # stacked over the 2 layers, like their bases
    assert layers.attn.lora["q"].a.shape == (2, 128, 4)
    assert layers.attn.lora["q"].b.shape == (2, 4, 4, 32)
    assert layers.attn.lora["o"].a.shape == (2, 4, 32, 4) and layers.mlp.lora["down"].a.shape == (
        2, 384, 4)
    assert layers.attn.lora["q"].a.get_metadata()["out_sharding"] == ("layers", "embed", None)
    assert layers.attn.lora["q"].b.get_metadata()["out_sharding"] == (
        "layers", None, "heads", "head_dim")
    assert isinstance(layers.attn.lora["q"].a, nnx.LoRAParam)
    # each layer draws its own A
    assert float(jnp.abs(layers.attn.lora["q"].a[0] - layers.attn.lora["q"].a[1]).max()) > 0
    # a subset of targets touches only those projections
    only = add_lora(tiny(), LoraSpec(2, 2.0, ("v", "up")))
    assert set(only.backbone.layers.attn.lora) == {"v"}
    assert set(only.backbone.layers.mlp.lora) == {"up"}


def test_moved_adapters_change_every_forward_alike_and_merge_into_the_weights(tmp_path):
    tok = tokens()
    model = moved(add_lora(tiny(), ALL, seed=1))
    full, hidden, cached = three_forwards(model, tok)
    base_logits = tiny()(tok)
    assert float(jnp.abs(full - base_logits).max()) > 1e-2  # the adapters do something
    np.testing.assert_allclose(hidden, full, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(cached, full, rtol=1e-5, atol=1e-5)
    merged = merge_lora(model)
    assert not nnx.state(merged, nnx.LoRAParam)  # a plain model again
    np.testing.assert_allclose(merged(tok), full, rtol=1e-5, atol=1e-5)
    save_pretrained(merged, tmp_path / "hf")  # export: merged HF weights
    np.testing.assert_allclose(from_pretrained(tmp_path / "hf")(tok), full, rtol=1e-5,
                               atol=1e-5)


def test_the_peft_adapter_folder_adds_up_to_the_merged_weights(tmp_path):
    """PEFT's rule, W + (alpha / r) B A per HF tensor, applied to the exported adapters and the
    base's HF weights gives the merged export's weights: the adapter folder means what the
    run trained."""
    import json

    from safetensors.numpy import load_file

    save_pretrained(tiny(), tmp_path / "base")
    model = moved(add_lora(tiny(), ALL, seed=3))
    save_peft_adapter(model, tmp_path / "adapter", alpha=ALL.alpha, base_model="owner/base")
    save_pretrained(merge_lora(model), tmp_path / "merged")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (
        4, 8.0, "owner/base")
    assert config["target_modules"] == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    lora = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    base = load_file(tmp_path / "base" / "model.safetensors")
    merged = load_file(tmp_path / "merged" / "model.safetensors")
    n_adapted = 0
    for name, w in base.items():
        pre = f"base_model.model.{name.removesuffix('.weight')}."
        if pre + "lora_A.weight" in lora:
            a, b = lora[pre + "lora_A.weight"], lora[pre + "lora_B.weight"]
            assert a.shape == (4, w.shape[1]) and b.shape == (w.shape[0], 4)
            w = w + (config["lora_alpha"] / config["r"]) * (b @ a)
            n_adapted += 1
        np.testing.assert_allclose(w, merged[name], rtol=1e-5, atol=1e-6)
    assert n_adapted == 7 * model.config.num_layers == len(lora) // 2


def test_split_and_join_are_inverse_and_share_leaves():
    params = nnx.to_pure_dict(nnx.state(add_lora(ValueModel(ModelConfig.tiny(vocab_size=32),
                                                            rngs=nnx.Rngs(0)), ALL)))
    train, frozen = split_trainable(params, VALUE_HEAD)
    assert set(train) == {"backbone", "head", "head_bias"} and "head" not in frozen
    assert all("lora" not in str(p) for p, _ in jax.tree_util.tree_leaves_with_path(frozen))
    back = join_params(train, frozen)
    assert jax.tree.structure(back) == jax.tree.structure(params)
    assert all(a is b for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params),
                                      strict=True))


@pytest.mark.slow  # ~6 s in one process on 2 shared cores
def test_adapters_are_placed_like_their_base_on_a_mesh(devices8):
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    tok = tokens(4, 8)
    model = moved(add_lora(tiny(), ALL, seed=2))
    want = model(tok)
    shard_model(model, mesh)
    q = model.backbone.layers.attn.lora["q"]
    assert q.a.get_value().sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", None)
    assert q.b.get_value().sharding.spec == jax.sharding.PartitionSpec(None, None, "tensor",
                                                                       None)
    graphdef, state = nnx.split(model)
    got = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))(state, tok)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def _batch(rows: int, width: int):
    rng = np.random.default_rng(0)
    f = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    return batch_and_targets({
        "tokens": jnp.asarray(rng.integers(2, 30, (rows, width)), jnp.int32),
        "attn": jnp.ones((rows, width), bool),
        "sample_logprobs": f(-rng.random((rows, width)) * 3),
        "advantages": f(rng.normal(size=(rows, width))),
        "policy_mask": f(rng.random((rows, width)) < 0.8).at[:, 0].set(0.0),
        "positive_mask": f(rng.random((rows, width)) < 0.3),
        "values_old": f(rng.normal(size=(rows, width))),
        "returns": f(rng.normal(size=(rows, width))),
        "value_mask": f(rng.random((rows, width)) < 0.8)})


ALL_ROWS = RowPlan(np.full(4, 16), None, np.arange(4))  # _batch(4, 16): every row, full width


@pytest.mark.parametrize("kl_coef", [0.0, 0.5])
@pytest.mark.slow  # ~6 s in one process on 2 shared cores
def test_policy_update_trains_only_the_adapters(kl_coef):
    graphdef, state = nnx.split(add_lora(tiny(), ALL, seed=0))
    params = nnx.to_pure_dict(state)
    cfg = LearnerConfig(algo=AlgoConfig(kl_coef=kl_coef), optim=OptimConfig(minibatches=1),
                        window=8, temperature=1.0)
    tx = optax.adam(1e-3)
    learner = learner_with(graphdef, None, cfg, tx_policy=tx, trainable=((), None))
    adapters, base = split_trainable(params)
    opt = tx.init(adapters)
    for moment in ("mu", "nu"):  # AdamW states of the adapters' shapes, nothing else
        assert jax.tree.structure(optax.tree.get(opt, moment)) == jax.tree.structure(adapters)
    assert sum(x.size for x in jax.tree.leaves(opt)) == 2 * sum(
        x.size for x in jax.tree.leaves(adapters)) + 1  # + the step count
    start = jax.device_get(params)
    new, opt, stats = update(learner, "policy", jax.tree.map(jnp.array, params), opt,
                             *_batch(4, 16), ALL_ROWS)  # no ref: the base is the reference
    new_adapters, new_base = split_trainable(jax.device_get(new))
    for a, b in zip(jax.tree.leaves(new_base), jax.tree.leaves(split_trainable(start)[1]),
                    strict=True):
        np.testing.assert_array_equal(a, b)
    old_adapters = split_trainable(start)[0]
    for path, x in jax.tree_util.tree_leaves_with_path(new_adapters):
        was = old_adapters
        for k in path:
            was = was[k.key]
        # Standard LoRA: with B = 0 only B has a gradient; A moves from the second step on
        assert np.array_equal(x, was) == (path[-1].key == "a"), path
    assert (float(stats["kl_ref"]) == 0.0) if kl_coef else ("kl_ref" not in stats)


@pytest.mark.slow  # ~7 s in one process on 2 shared cores
def test_value_update_trains_adapters_and_head():
    graphdef, state = nnx.split(add_lora(ValueModel(ModelConfig.tiny(vocab_size=32),
                                                    rngs=nnx.Rngs(0)), ALL))
    params = nnx.to_pure_dict(state)
    cfg = LearnerConfig(algo=AlgoConfig(), optim=OptimConfig(minibatches=1), window=8,
                        temperature=1.0)
    tx = optax.adamw(1e-3)
    learner = learner_with(None, graphdef, cfg, tx_value=tx, trainable=(None, VALUE_HEAD))
    start = jax.device_get(params)
    new, _, _ = update(learner, "value", jax.tree.map(jnp.array, params),
                       tx.init(split_trainable(params, VALUE_HEAD)[0]), *_batch(4, 16),
                       ALL_ROWS)
    new = jax.device_get(new)
    assert not np.array_equal(new["head"], start["head"])
    np.testing.assert_array_equal(new["backbone"]["embed"], start["backbone"]["embed"])
    np.testing.assert_array_equal(new["backbone"]["layers"]["mlp"]["up"],
                                  start["backbone"]["layers"]["mlp"]["up"])


@pytest.mark.slow  # ~13 s in one process on 2 shared cores
def test_policy_update_on_a_mesh_matches_the_unsharded_one(devices8):
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    model = moved(add_lora(tiny(), ALL, seed=4), by=0.01)  # B != 0: A gets gradients too
    graphdef, state = nnx.split(model)
    params = nnx.to_pure_dict(state)
    cfg = LearnerConfig(algo=AlgoConfig(kl_coef=0.5), optim=OptimConfig(minibatches=1),
                        window=8, temperature=1.0)
    tx = optax.adam(1e-3)
    batch = _batch(4, 16)
    plain, _, _ = update(learner_with(graphdef, None, cfg, tx_policy=tx, trainable=((), None)),
                         "policy", jax.tree.map(jnp.array, params),
                         tx.init(split_trainable(params)[0]), *batch, ALL_ROWS)
    shard_model(model, mesh)
    placed = nnx.to_pure_dict(nnx.state(model))
    opt = commit_to_mesh(tx.init(split_trainable(placed)[0]), mesh)  # as trainer/trainer.py
    state = TrainState(placed, None, opt, None)  # no critic: only the policy updates
    learner = learner_with(graphdef, None, cfg, tx_policy=tx, mesh=mesh, state=state,
                           trainable=((), None))
    new, _, _ = update(learner, "policy", placed, opt, *batch, ALL_ROWS)
    q = new["backbone"]["layers"]["attn"]["lora"]["q"]
    assert q["b"].sharding.spec == jax.sharding.PartitionSpec(None, None, "tensor", None)
    assert new["backbone"]["embed"] is placed["backbone"]["embed"]  # the base passes through
    for a, b in zip(jax.tree.leaves(jax.device_get(new)), jax.tree.leaves(jax.device_get(plain)),
                    strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-6)
