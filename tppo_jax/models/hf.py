"""Hugging Face checkpoint I/O: ``from_pretrained`` / ``save_pretrained`` (safetensors).

Supports ``Qwen2ForCausalLM`` and ``LlamaForCausalLM``. HF stores linear weights as
``[out, in]`` with heads flattened into the out dim; our params are ``[in, heads, head_dim]``
etc. (see ``transformer.py``). Each param is described by a ``_TensorMap``: the HF tensor is
*viewed* with its flattened dims split (e.g. ``[Hq*D, H] -> [Hq, D, H]``) and then transposed
by ``perm``. Loading goes through ``jax.make_array_from_callback`` so every device shard reads
only its own slice of the file (``safe_open(...).get_slice``): no host copy of the full model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import pathlib
from typing import Any

import jax
import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy so safetensors can read it)
import numpy as np
from flax import nnx
from jax.sharding import Mesh, SingleDeviceSharding
from safetensors import safe_open
from safetensors.numpy import save_file

from tppo_jax.models.transformer import ModelConfig, Transformer
from tppo_jax.parallel.mesh import named_sharding

SUPPORTED_ARCHITECTURES = ("Qwen2ForCausalLM", "LlamaForCausalLM")


# --------------------------------------------------------------------------- config


# transformers 5 may write only `model_type` (no `architectures`), e.g. SmolLM2's config.
MODEL_TYPES = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}
ROPE_TYPES = ("default", "linear", "llama3")


def _architecture(d: dict[str, Any]) -> str:
    archs = d.get("architectures") or []
    if archs:
        return str(archs[0])
    mt = d.get("model_type")
    if mt in MODEL_TYPES:
        return MODEL_TYPES[mt]
    raise ValueError(f"unsupported architecture (model_type {mt!r}); supported: "
                     f"{', '.join(SUPPORTED_ARCHITECTURES)} (model_type {', '.join(MODEL_TYPES)})")


def _rope(d: dict[str, Any], arch: str) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling or None) from 4.x top-level keys or 5.x ``rope_parameters``."""
    rope = dict(d.get("rope_parameters") or {})
    theta = float(rope.pop("rope_theta", d.get("rope_theta", 10000.0)))
    scaling = d.get("rope_scaling") or (rope or None)
    if scaling is None:
        return theta, None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ValueError(f"{arch}: rope scaling type {kind!r} is not supported "
                         f"(supported: {', '.join(ROPE_TYPES)})")
    if kind == "default":
        return theta, None
    if "factor" not in scaling:
        raise ValueError(f"{arch}: rope scaling {kind!r} has no 'factor'")
    return theta, {k: v for k, v in scaling.items() if k != "rope_theta"}


def config_from_hf(d: dict[str, Any], dtype: str = "float32") -> ModelConfig:
    """Builds a ``ModelConfig`` from an HF ``config.json`` dict (transformers 4.x or 5.x)."""
    arch = _architecture(d)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    if d.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{arch}: hidden_act {d['hidden_act']!r} unsupported (only silu)")
    if arch == "LlamaForCausalLM":
        if d.get("attention_bias") or d.get("mlp_bias"):
            raise ValueError(f"{arch}: attention_bias / mlp_bias checkpoints are not supported")
        qkv_bias = False
    else:
        if d.get("use_sliding_window"):
            raise ValueError(f"{arch}: sliding-window attention is not supported")
        qkv_bias = True
    theta, scaling = _rope(d, arch)
    heads = int(d["num_attention_heads"])
    return ModelConfig(
        vocab_size=int(d["vocab_size"]),
        hidden_size=int(d["hidden_size"]),
        intermediate_size=int(d["intermediate_size"]),
        num_layers=int(d["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(d.get("num_key_value_heads") or heads),
        head_dim=int(d.get("head_dim") or d["hidden_size"] // heads),
        rope_theta=theta,
        rope_scaling=scaling,
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        qkv_bias=qkv_bias,
        tie_embeddings=bool(d.get("tie_word_embeddings", False)),
        max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
        dtype=dtype,
    )


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """HF ``config.json`` dict: Qwen2 when the config has q/k/v bias, Llama otherwise.

    Uses the 4.x keys (``rope_theta``, ``rope_scaling``) which transformers 5 still reads.
    """
    qwen = cfg.qkv_bias
    d: dict[str, Any] = {
        "architectures": ["Qwen2ForCausalLM" if qwen else "LlamaForCausalLM"],
        "model_type": "qwen2" if qwen else "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling_dict,
        "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "max_position_embeddings": cfg.max_position_embeddings,
        "torch_dtype": cfg.dtype,
    }
    if qwen:
        d["use_sliding_window"] = False
    else:
        d.update(attention_bias=False, mlp_bias=False)
    return d


def write_special_ids(path: str | pathlib.Path, *, bos_id: int | None,
                      eos_ids: tuple[int, ...] | list[int], pad_id: int | None) -> None:
    """Adds the tokenizer's BOS / EOS / pad ids to ``path/config.json`` and writes them to
    ``path/generation_config.json`` (keeping the other keys of one already there).

    Without them transformers' ``generate`` on the folder never stops: it reads the ids that
    end a generation from these two files, not from the tokenizer. Every EOS id goes in (an
    instruct model's end-of-turn token as well as ``</s>``), as an int when there is one.
    """
    path = pathlib.Path(path)
    eos: int | list[int] | None = (None if not eos_ids else int(eos_ids[0]) if len(eos_ids) == 1
                                   else [int(i) for i in eos_ids])
    ids = {k: v for k, v in (("bos_token_id", bos_id), ("eos_token_id", eos),
                             ("pad_token_id", pad_id)) if v is not None}
    for name in ("config.json", "generation_config.json"):
        f = path / name
        d = json.loads(f.read_text()) if f.exists() else {}
        d.update(ids)
        f.write_text(json.dumps(d, indent=2) + "\n")


# --------------------------------------------------------------------------- tensor maps


@dataclasses.dataclass(frozen=True)
class _TensorMap:
    """``ours = hf.reshape(sum(groups, ())).transpose(perm)``; ``groups[i]`` splits HF dim i.

    A stacked decoder-layer param (``layers > 0``) is ``layers`` HF tensors, one per layer,
    named ``hf_name.format(layer=n)``, stacked on a leading axis of ours."""

    hf_name: str
    groups: tuple[tuple[int, ...], ...]
    perm: tuple[int, ...]
    layers: int = 0

    @property
    def hf_shape(self) -> tuple[int, ...]:
        return tuple(math.prod(g) for g in self.groups)

    def hf_names(self) -> list[str]:
        """Every HF tensor this param reads, in layer order."""
        if not self.layers:
            return [self.hf_name]
        return [self.hf_name.format(layer=n) for n in range(self.layers)]


def _tensor_maps(cfg: ModelConfig) -> dict[tuple[Any, ...], _TensorMap]:
    """Our state path -> HF tensor(s), for every parameter of ``Transformer(cfg)``."""
    h, i, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    m: dict[tuple[Any, ...], _TensorMap] = {
        ("backbone", "embed"): _TensorMap("model.embed_tokens.weight", ((v,), (h,)), (0, 1)),
        ("backbone", "final_norm", "scale"): _TensorMap("model.norm.weight", ((h,),), (0,)),
    }
    if not cfg.tie_embeddings:
        m[("lm_head",)] = _TensorMap("lm_head.weight", ((v,), (h,)), (1, 0))
    pre, hf, n = ("backbone", "layers"), "model.layers.{layer}.", cfg.num_layers

    def layer(name: str, groups: tuple[tuple[int, ...], ...], perm: tuple[int, ...]):
        return _TensorMap(hf + name, groups, perm, n)

    m[pre + ("attn_norm", "scale")] = layer("input_layernorm.weight", ((h,),), (0,))
    m[pre + ("mlp_norm", "scale")] = layer("post_attention_layernorm.weight", ((h,),), (0,))
    for name, heads in (("q", hq), ("k", hkv), ("v", hkv)):
        proj = f"self_attn.{name}_proj."
        m[pre + ("attn", name)] = layer(proj + "weight", ((heads, d), (h,)), (2, 0, 1))
        if cfg.qkv_bias:
            m[pre + ("attn", f"{name}_bias")] = layer(proj + "bias", ((heads, d),), (0, 1))
    m[pre + ("attn", "o")] = layer("self_attn.o_proj.weight", ((h,), (hq, d)), (1, 2, 0))
    for name in ("gate", "up"):
        m[pre + ("mlp", name)] = layer(f"mlp.{name}_proj.weight", ((i,), (h,)), (1, 0))
    m[pre + ("mlp", "down")] = layer("mlp.down_proj.weight", ((h,), (i,)), (1, 0))
    return m


def _read_slice(sl: Any, tm: _TensorMap, index: tuple[slice, ...], shape: tuple[int, ...]):
    """Reads the part of HF tensor ``sl`` (a safetensors slice) that lands in ``ours[index]``."""
    ours = [s.indices(n)[:2] for s, n in zip(index, shape, strict=True)]
    view: list[tuple[int, int]] = [(0, 0)] * len(ours)
    for j, p in enumerate(tm.perm):
        view[p] = ours[j]
    # Per HF dim only its outermost split dim can be range-read contiguously; inner split dims
    # are read whole and cut afterwards (they are head_dim-sized, i.e. small).
    hf_index, post, read_shape, k = [], [], [], 0
    for g in tm.groups:
        inner = math.prod(g[1:])
        lo, hi = view[k]
        hf_index.append(slice(lo * inner, hi * inner))
        read_shape.append(hi - lo)
        post.append(slice(None))
        for off, size in enumerate(g[1:], start=1):
            read_shape.append(size)
            post.append(slice(*view[k + off]))
        k += len(g)
    arr = np.asarray(sl[tuple(hf_index)]).reshape(read_shape)[tuple(post)]
    return arr.transpose(tm.perm)


def _weight_files(path: pathlib.Path) -> dict[str, pathlib.Path]:
    """HF tensor name -> safetensors file holding it."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {k: path / f for k, f in weight_map.items()}
    single = path / "model.safetensors"
    if not single.exists():
        raise FileNotFoundError(f"{path}: no model.safetensors or model.safetensors.index.json")
    with safe_open(str(single), framework="numpy") as f:
        return dict.fromkeys(f.keys(), single)


# --------------------------------------------------------------------------- load / save


def _state_paths(state: Any) -> list[tuple[tuple[Any, ...], nnx.Variable]]:
    """(path of plain keys, Variable) for every Variable of an ``nnx.State``, in tree order."""
    flat = jax.tree_util.tree_flatten_with_path(
        state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return [(tuple(getattr(k, "key", getattr(k, "idx", k)) for k in p), var) for p, var in flat[0]]


def from_pretrained(path: str | pathlib.Path, *, dtype: str = "float32",
                    mesh: Mesh | None = None, remat: bool = False,
                    attention: str = "auto") -> Transformer:
    """Loads an HF Qwen2/Llama checkpoint directory into a ``Transformer``.

    Args:
      path: directory with ``config.json`` and ``model.safetensors`` (or a sharded index).
      dtype: param dtype of the returned model (tensors are cast on read).
      mesh: if given, every param is created directly in ``named_sharding(mesh, axes)``.
      remat: recompute each layer in the backward pass (activation memory of one layer).
      attention: the training forward's attention (``kernels/attention.py`` ``IMPLS``).
    """
    path = pathlib.Path(path)
    cfg = config_from_hf(json.loads((path / "config.json").read_text()), dtype)
    cfg = dataclasses.replace(cfg, remat=remat, attention=attention)
    files = _weight_files(path)
    maps = _tensor_maps(cfg)
    missing = sorted(name for tm in maps.values() for name in tm.hf_names()
                     if name not in files)
    if missing:
        raise ValueError(f"{path}: checkpoint is missing tensors: {', '.join(missing)}")
    abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    graphdef, abs_state = nnx.split(abstract)
    np_dtype = np.dtype(cfg.jnp_dtype)
    leaves = []
    with contextlib.ExitStack() as stack:
        handles: dict[pathlib.Path, Any] = {}

        def get_slice(name: str, tm: _TensorMap) -> Any:
            fname = files[name]
            if fname not in handles:
                handles[fname] = stack.enter_context(safe_open(str(fname), framework="numpy"))
            sl = handles[fname].get_slice(name)
            if tuple(sl.get_shape()) != tm.hf_shape:
                raise ValueError(f"{name}: shape {sl.get_shape()} != expected {tm.hf_shape}")
            return sl

        for key, var in _state_paths(abs_state):
            tm = maps[key]
            slices = [get_slice(name, tm) for name in tm.hf_names()]
            shape = tuple(var.shape)
            if mesh is None:
                sharding = SingleDeviceSharding(jax.local_devices()[0])  # this host's
            else:
                sharding = named_sharding(mesh, var.get_metadata()["out_sharding"], shape)
            arr = jax.make_array_from_callback(
                shape, sharding,
                lambda idx, slices=slices, tm=tm, shape=shape: _read_param(
                    slices, tm, idx, shape).astype(np_dtype),
            )
            leaves.append(var.replace(arr))
    treedef = jax.tree_util.tree_structure(
        abs_state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, leaves))


def _read_param(slices: list[Any], tm: _TensorMap, index: tuple[slice, ...],
                shape: tuple[int, ...]) -> np.ndarray:
    """``ours[index]`` read from its HF tensor(s): a stacked layer param reads the layers
    ``index[0]`` covers, each through ``_read_slice``, and stacks them."""
    if not tm.layers:
        return _read_slice(slices[0], tm, index, shape)
    lo, hi, _ = index[0].indices(shape[0])
    return np.stack([_read_slice(slices[n], tm, index[1:], shape[1:]) for n in range(lo, hi)])


def _to_hf(x: jax.Array | np.ndarray, tm: _TensorMap) -> np.ndarray:
    # Single-process gather; multi-host saving would need process_allgather first.
    arr = np.asarray(jax.device_get(x))
    return np.ascontiguousarray(arr.transpose(np.argsort(tm.perm)).reshape(tm.hf_shape))


def save_pretrained(model: Transformer, path: str | pathlib.Path, *,
                    max_shard_bytes: int | None = None) -> None:
    """Writes ``config.json`` + safetensors in HF layout (loadable by transformers).

    Args:
      max_shard_bytes: split into ``model-XXXXX-of-YYYYY.safetensors`` + index when the
        weights exceed this many bytes (None: one ``model.safetensors``).
    """
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    maps = _tensor_maps(cfg)
    tensors = {}
    for k, var in _state_paths(nnx.state(model, nnx.Param)):
        tm = maps[k]
        if tm.layers:  # one HF tensor per layer of the stack
            arr = np.asarray(jax.device_get(var.get_value()))
            tensors.update((name, _to_hf(arr[n], tm)) for n, name in enumerate(tm.hf_names()))
        else:
            tensors[tm.hf_name] = _to_hf(var.get_value(), tm)
    (path / "config.json").write_text(json.dumps(config_to_hf(cfg), indent=2) + "\n")
    meta = {"format": "pt"}
    total = sum(t.nbytes for t in tensors.values())
    if max_shard_bytes is None or total <= max_shard_bytes:
        save_file(tensors, str(path / "model.safetensors"), metadata=meta)
        _as_umask_allows(path / "model.safetensors")
        return
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, t in tensors.items():
        if shards[-1] and size + t.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += t.nbytes
    weight_map = {}
    for n, shard in enumerate(shards, start=1):
        fname = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / fname), metadata=meta)
        _as_umask_allows(path / fname)
        weight_map.update(dict.fromkeys(shard, fname))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _as_umask_allows(path: pathlib.Path) -> None:
    """Gives ``path`` the mode a plain ``open`` would (0666 less the umask): safetensors
    writes its files 0600, which other users' tools on a shared machine cannot read."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


# --------------------------------------------------------------------------- LoRA adapters

# Our projection name -> its module in the HF decoder layer (what PEFT's target_modules name).
HF_PROJECTIONS = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
                  "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
                  "down": "mlp.down_proj"}


def peft_adapter_tensors(model: Transformer) -> dict[str, np.ndarray]:
    """A LoRA model's adapters as PEFT names them: per targeted projection
    ``...lora_A.weight [r, in]`` and ``...lora_B.weight [out, r]``, so that
    ``W_hf + (alpha / r) B_hf A_hf`` is the merged HF weight. Our ``A`` spans the weight's
    contracted dims and ``B`` its output dims, each in HF's flattening order."""
    tensors = {}
    layers = model.backbone.layers
    for owner in ("attn", "mlp"):
        adapters = getattr(layers, owner).lora
        for name, adapter in (adapters.items() if adapters is not None else ()):
            # Stacked: a [L, *contracted, r], b [L, r, *kept].
            a_all = np.asarray(jax.device_get(adapter.a[...]), np.float32)
            b_all = np.asarray(jax.device_get(adapter.b[...]), np.float32)
            for n, (a, b) in enumerate(zip(a_all, b_all, strict=True)):
                r = a.shape[-1]
                pre = f"base_model.model.model.layers.{n}.{HF_PROJECTIONS[name]}."
                tensors[pre + "lora_A.weight"] = np.ascontiguousarray(a.reshape(-1, r).T)
                tensors[pre + "lora_B.weight"] = np.ascontiguousarray(b.reshape(r, -1).T)
    return tensors


def save_peft_adapter(model: Transformer, path: str | pathlib.Path, *, alpha: float,
                      base_model: str | None) -> None:
    """Writes ``model``'s LoRA adapters (not merged) as a PEFT adapter folder:
    ``adapter_model.safetensors`` + ``adapter_config.json`` (``base_model``: the HF id or
    folder they apply to, None when the run's base is no HF model)."""
    tensors = peft_adapter_tensors(model)
    if not tensors:
        raise ValueError("the model has no LoRA adapters")
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    rank = next(iter(tensors.values())).shape[0]
    targets = sorted({k.split(".")[-3] for k in tensors})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
              "r": rank, "lora_alpha": alpha, "target_modules": targets, "lora_dropout": 0.0,
              "bias": "none", "fan_in_fan_out": False, "inference_mode": True}
    save_file(tensors, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
    _as_umask_allows(path / "adapter_model.safetensors")
    (path / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
