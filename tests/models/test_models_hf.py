"""HF checkpoint parity (fixtures made by tests/fixtures/make_hf_fixtures.py) and round trips."""

import json
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from tppo_jax.models.hf import config_from_hf, from_pretrained, save_pretrained
from tppo_jax.models.transformer import ModelConfig, Transformer
from tppo_jax.parallel.mesh import make_mesh

FIXTURES = pathlib.Path(__file__).parents[1] / "fixtures" / "hf"
fwd = nnx.jit(lambda m, t, a: m(t, attention_mask=a))


def _check_parity(model, name):
    ref = np.load(FIXTURES / name / "reference.npz")
    logits = fwd(model, jnp.asarray(ref["tokens"]), jnp.asarray(ref["attention_mask"]))
    valid = ref["attention_mask"].astype(bool)
    diff = np.abs(np.asarray(logits) - ref["logits"])[valid]
    assert diff.max() <= 1e-4, (name, diff.max())


@pytest.mark.parametrize("name", ["qwen2", "llama"])
def test_parity_with_transformers(name):
    model = from_pretrained(FIXTURES / name)
    cfg = model.config
    if name == "qwen2":
        assert cfg.qkv_bias and cfg.tie_embeddings and cfg.rope_scaling is None
    else:
        assert not cfg.qkv_bias and not cfg.tie_embeddings
        assert cfg.rope_scaling_dict["rope_type"] == "llama3" and cfg.rope_theta == 500000.0
    _check_parity(model, name)


def test_parity_sharded_load(devices8):
    mesh = make_mesh({"fsdp": 4, "tensor": 2})
    model = from_pretrained(FIXTURES / "llama", mesh=mesh)  # sharded index checkpoint
    gate = model.backbone.layers.mlp.gate[...]  # [L, H, I], each layer read from its tensor
    assert gate.sharding.spec == P(None, "fsdp", "tensor")
    assert gate.addressable_shards[0].data.shape == (model.config.num_layers, 64 // 4, 128 // 2)
    _check_parity(model, "llama")


@pytest.mark.parametrize("shard_bytes", [None, 60_000])
def test_round_trip(tmp_path, shard_bytes):
    cfg = ModelConfig.tiny(vocab_size=96, num_layers=2, tie_embeddings=False,
                           rope_scaling={"rope_type": "linear", "factor": 2.0})
    model = Transformer(cfg, rngs=nnx.Rngs(4))
    save_pretrained(model, tmp_path, max_shard_bytes=shard_bytes)
    index = tmp_path / "model.safetensors.index.json"
    assert index.exists() == (shard_bytes is not None)
    hf_cfg = json.loads((tmp_path / "config.json").read_text())
    assert hf_cfg["architectures"] == ["Qwen2ForCausalLM"]
    loaded = from_pretrained(tmp_path)
    assert loaded.config == cfg
    for (p, a), (_, b) in zip(nnx.to_flat_state(nnx.state(model)),
                              nnx.to_flat_state(nnx.state(loaded)), strict=True):
        np.testing.assert_array_equal(a[...], b[...], err_msg=str(p))


def test_hf_layout_names(tmp_path):
    from safetensors import safe_open

    model = Transformer(ModelConfig.tiny(vocab_size=32, num_layers=1, qkv_bias=False),
                        rngs=nnx.Rngs(0))
    save_pretrained(model, tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="numpy") as f:
        keys = set(f.keys())
        q = f.get_tensor("model.layers.0.self_attn.q_proj.weight")
    assert "lm_head.weight" not in keys and "model.embed_tokens.weight" in keys
    assert q.shape == (4 * 32, 128)  # [out, in]
    np.testing.assert_array_equal(
        q.reshape(4, 32, 128).transpose(2, 0, 1), model.backbone.layers.attn.q[...][0])
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == [
        "LlamaForCausalLM"]


def test_bf16_load():
    model = from_pretrained(FIXTURES / "qwen2", dtype="bfloat16")
    assert model.backbone.embed[...].dtype == jnp.bfloat16
    ref = np.load(FIXTURES / "qwen2" / "reference.npz")
    logits = fwd(model, jnp.asarray(ref["tokens"]), jnp.asarray(ref["attention_mask"]))
    assert np.abs(np.asarray(logits) - ref["logits"]).max() < 0.1


def test_unsupported_architecture(tmp_path):
    shutil.copytree(FIXTURES / "qwen2", tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["architectures"] = ["MistralForCausalLM"]
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="MistralForCausalLM"):
        from_pretrained(tmp_path / "m")


def test_missing_tensors_are_named(tmp_path):
    from safetensors.numpy import save_file

    src = FIXTURES / "qwen2"
    shutil.copy(src / "config.json", tmp_path / "config.json")
    from safetensors import safe_open

    with safe_open(str(src / "model.safetensors"), framework="numpy") as f:
        names = [k for k in f.keys() if "layers.1.mlp.up_proj" not in k]  # noqa: SIM118
        tensors = {k: f.get_tensor(k) for k in names}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        from_pretrained(tmp_path)


def test_config_v4_keys():
    d = json.loads((FIXTURES / "llama" / "config.json").read_text())
    rope = d.pop("rope_parameters")
    d["rope_theta"] = rope.pop("rope_theta")
    d["rope_scaling"] = rope
    cfg = config_from_hf(d)
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling_dict["factor"] == 8.0
    assert jax.tree.leaves(cfg.rope_scaling)  # stored hashable
