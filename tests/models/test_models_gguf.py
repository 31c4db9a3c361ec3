"""GGUF -> HF folder: a tiny random Llama / Qwen2 GGUF written here with ``gguf.GGUFWriter``
(the writer llama.cpp's converter uses), converted, and loaded back: weights (including the
Llama Q/K row permutation and a Q8_0-quantized tensor), config and tokenizer round trip."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
from flax import nnx
from tokenizers.pre_tokenizers import ByteLevel

from tppo_jax.data.prompts import prompt_builder
from tppo_jax.models.gguf import GGUFError, convert_gguf, resolve_model_path
from tppo_jax.models.hf import _state_paths, _tensor_maps, config_from_hf, from_pretrained
from tppo_jax.models.tokenizer import Tokenizer

H, HEADS, KV, D, FF, LAYERS = 32, 2, 1, 16, 64, 2
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
          "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|im_start|>assistant\\n' }}{% endif %}")


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf does to Llama Q/K rows (HF halves -> pairs)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def _vocab() -> tuple[list[str], list[int], list[str]]:
    tokens = sorted(ByteLevel.alphabet()) + ["Ġt", "Ġth", "he"] + SPECIALS
    types = [1] * (len(tokens) - len(SPECIALS)) + [3] * len(SPECIALS)
    return tokens, types, ["Ġ t", "Ġt h", "h e"]


def _hf_weights(arch: str, vocab: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Random weights under HF names and shapes."""
    w = {"model.embed_tokens.weight": (vocab, H), "model.norm.weight": (H,),
         "lm_head.weight": (vocab, H)}
    for n in range(LAYERS):
        p = f"model.layers.{n}."
        w.update({p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                  p + "self_attn.q_proj.weight": (HEADS * D, H),
                  p + "self_attn.k_proj.weight": (KV * D, H),
                  p + "self_attn.v_proj.weight": (KV * D, H),
                  p + "self_attn.o_proj.weight": (H, HEADS * D),
                  p + "mlp.gate_proj.weight": (FF, H), p + "mlp.up_proj.weight": (FF, H),
                  p + "mlp.down_proj.weight": (H, FF)})
        if arch == "qwen2":
            w.update({p + "self_attn.q_proj.bias": (HEADS * D,),
                      p + "self_attn.k_proj.bias": (KV * D,),
                      p + "self_attn.v_proj.bias": (KV * D,)})
    return {k: rng.standard_normal(s).astype(np.float32) * 0.1 for k, s in w.items()}


GGUF_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
              "output_norm.weight", "lm_head.weight": "output.weight",
              "input_layernorm.weight": "attn_norm.weight",
              "post_attention_layernorm.weight": "ffn_norm.weight",
              "self_attn.o_proj.weight": "attn_output.weight",
              "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
              "mlp.down_proj.weight": "ffn_down.weight",
              **{f"self_attn.{x}_proj.{k}": f"attn_{x}.{k}" for x in "qkv"
                 for k in ("weight", "bias")}}


def _gguf_name(hf: str) -> str:
    if hf in GGUF_NAMES:
        return GGUF_NAMES[hf]
    _, _, n, rest = hf.split(".", 3)
    return f"blk.{n}.{GGUF_NAMES[rest]}"


def write_gguf(path: Path, arch: str, weights: dict[str, np.ndarray], *,
               quantize: str | None = None) -> None:
    tokens, types, merges = _vocab()
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(LAYERS)
    w.add_context_length(128)
    w.add_embedding_length(H)
    w.add_feed_forward_length(FF)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index("<|im_start|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)
    for name, arr in weights.items():
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            arr = _permute(arr, HEADS if "q_proj" in name else KV)
        if name == quantize:
            q = gguf.quants.quantize(arr, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(_gguf_name(name), q, raw_shape=q.shape,
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(_gguf_name(name), arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _loaded_hf(folder: Path) -> dict[str, np.ndarray]:
    """The converted folder, loaded into our model and mapped back to HF names/layout."""
    model = from_pretrained(folder)
    maps = _tensor_maps(model.config)
    out = {}
    for key, var in _state_paths(nnx.state(model, nnx.Param)):
        tm = maps[key]
        arr = np.asarray(var.get_value())
        # a stacked layer param is one HF tensor per layer
        for name, a in (zip(tm.hf_names(), arr, strict=True) if tm.layers
                        else [(tm.hf_name, arr)]):
            out[name] = a.transpose(np.argsort(tm.perm)).reshape(tm.hf_shape)
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_gguf_weights_round_trip(tmp_path, arch):
    tokens, _, _ = _vocab()
    weights = _hf_weights(arch, len(tokens), np.random.default_rng(0))
    quant = "model.layers.1.mlp.up_proj.weight"
    write_gguf(tmp_path / "m.gguf", arch, weights, quantize=quant)
    folder = convert_gguf(tmp_path / "m.gguf", tmp_path / "hf")
    cfg = config_from_hf(json.loads((folder / "config.json").read_text()))
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.qkv_bias, cfg.tie_embeddings) == (LAYERS, H, HEADS, KV, D, arch == "qwen2", False)
    loaded = _loaded_hf(folder)
    assert set(loaded) == set(weights)
    for name, want in weights.items():
        if name == quant:  # Q8_0: 8-bit blocks of 32 with a float16 scale
            np.testing.assert_allclose(loaded[name], want, atol=np.abs(want).max() / 100)
        else:  # exact, Q/K included: the Llama permutation is undone
            np.testing.assert_array_equal(loaded[name], want, err_msg=name)


def test_gguf_tokenizer_round_trip(tmp_path):
    tokens, _, _ = _vocab()
    write_gguf(tmp_path / "m.gguf", "llama", _hf_weights("llama", len(tokens),
                                                         np.random.default_rng(1)))
    tok = Tokenizer.load(convert_gguf(tmp_path / "m.gguf", tmp_path / "hf"))
    assert tok.vocab_size == len(tokens)
    assert (tok.bos_id, tok.eos_id) == (tokens.index("<|im_start|>"), tokens.index("<|im_end|>"))
    assert tok.eos_ids == (tok.eos_id,) and not tok.add_bos and tok.chat_template == CHATML
    ids = tok.encode(" the hat")
    assert [tokens[i] for i in ids] == ["Ġth", "e", "Ġ", "h", "a", "t"]  # the merges apply
    assert tok.decode(ids) == " the hat"
    # Specials are single tokens in text, and the chat prompt starts with BOS exactly once.
    from tppo_jax.config import from_dict

    cfg = from_dict({"model": {"source": "gguf", "path": "x.gguf"}, "data": {"format": "gsm8k"}})
    ids = prompt_builder(cfg, tok).ids("1+1?", tok)
    assert ids[0] == tok.bos_id and ids.count(tok.bos_id) == 2  # user + assistant turns
    assert tok.decode(ids, skip_special=False).endswith("<|im_start|>assistant\n")


def test_gguf_errors_are_one_line(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(GGUFError, match="not a readable GGUF"):
        convert_gguf(bad, tmp_path / "out")
    with pytest.raises(GGUFError, match="no such GGUF"):
        convert_gguf(tmp_path / "missing.gguf", tmp_path / "out")
    with pytest.raises(GGUFError, match="is not installed"):
        resolve_model_path("pypi:no-such-dist-tppo")
    w = gguf.GGUFWriter(str(tmp_path / "gpt2.gguf"), "gpt2")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFError, match="architecture 'gpt2' is not supported"):
        convert_gguf(tmp_path / "gpt2.gguf", tmp_path / "out")
