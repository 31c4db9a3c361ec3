"""Per-chip memory plan of a T-PPO run on a TPU slice (``tppo plan``).

Arithmetic: for the policy and the value model it counts params, AdamW states and gradients
with the layout the code has (every param's shape and logical axes read off the model with
``nnx.eval_shape``, ``model_tensors``; each axis through
``parallel.mesh.LOGICAL_RULES``, an axis dropped where it does not divide, as ``_fits`` does),
adds training activations under remat and the engine's KV pages, and compares the total with
the chip's HBM.

Model (bytes per chip):
- params: elements of the local shard x dtype bytes (the value head is float32);
- optimizer: with ``model.param_dtype: float32`` (the default) AdamW m and v in float32
  (8 B/param) plus the float32 master of a bf16 param (4 B/param); with
  ``model.param_dtype: bfloat16`` m and v in bf16 (4 B/param) and no master;
- gradients: one param-dtype copy;
- LoRA (``model.lora_rank > 0``): the params are the base plus float32 adapters (``A [in, r]``,
  ``B [r, out]`` per targeted projection and layer, sharded like their base's dims), and the
  optimizer states and gradients cover only what trains: the adapters (and, with
  ``model.value_lora``, the critic's value head); the frozen base has neither;
- activations (remat): the saved layer inputs, ``tokens_per_chip * hidden * bytes * layers``,
  plus one layer's recompute working set (inputs, q/k/v, attention output, gate/up/act, and
  their cotangents). ``tokens_per_chip`` = one mini-batch (``slots / optim.minibatches``
  sequences of ``max_prompt_len + max_response_len`` tokens) split over data x fsdp; the
  sequence and tensor axes do not split [B, T, H] activations in ``LOGICAL_RULES``. Attention
  is assumed memory-efficient (flash/splash); the dense path's [T, T] scores are reported as
  a note, not in the total. Policy and value updates are separate jits, so the peak is the max
  of the two, not the sum;
- KV pages: ``slots * (prompt + L)`` tokens (or ``num_pages * page_size`` when set) x
  ``layers * 2 * kv_heads * head_dim * bytes``, kv heads split over tensor and slots over
  data x fsdp. Unfinished sequences keep their pages across steps, so the pool is live while
  training.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from functools import lru_cache, partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from tppo_jax.config import Config, ConfigError
from tppo_jax.config_checks import parse_lora_targets
from tppo_jax.launch import GIB, TpuType, parse_tpu_type
from tppo_jax.parallel.mesh import LOGICAL_RULES, MESH_AXES

DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


@dataclass(frozen=True)
class Arch:
    """The sizes of a Qwen2/Llama decoder the plan needs (HF ``config.json`` names)."""

    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    qkv_bias: bool
    tie_embeddings: bool

    def model_config(self, dtype: str = "bfloat16", **overrides: Any):
        """The ``ModelConfig`` of this architecture (random-weight benchmarks build it)."""
        from tppo_jax.models.transformer import ModelConfig

        return ModelConfig(vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                           intermediate_size=self.intermediate_size, num_layers=self.num_layers,
                           num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                           head_dim=self.head_dim, qkv_bias=self.qkv_bias,
                           tie_embeddings=self.tie_embeddings, dtype=dtype, **overrides)

    def policy_tensors(self) -> Iterator[Tensor]:
        """(shape, logical axes, always-fp32) of every policy param, read off the model
        (``model_tensors``)."""
        yield from model_tensors(self.model_config(), "policy")

    def value_tensors(self) -> Iterator[Tensor]:
        """The critic: the backbone (no LM head) + a float32 scalar head (value.py)."""
        yield from model_tensors(self.model_config(), "value")

    def value_head_tensors(self) -> Iterator[Tensor]:
        yield from model_tensors(self.model_config(), "value_head")

    def lora_tensors(self, rank: int, targets: tuple[str, ...]) -> Iterator[Tensor]:
        """The float32 LoRA adapters (models/lora.py): per layer and targeted projection,
        ``A [in..., r]`` and ``B [r, out...]`` with their base dims' axes."""
        yield from model_tensors(self.model_config(), "lora", rank, tuple(targets))

    @property
    def n_params(self) -> int:
        return sum(math.prod(s) for s, _, _ in self.policy_tensors())

    @property
    def n_value_params(self) -> int:
        return sum(math.prod(s) for s, _, _ in self.value_tensors())


Tensor = tuple[tuple[int, ...], tuple[str | None, ...], bool]


@lru_cache(maxsize=32)
def model_tensors(mc: Any, part: str, rank: int = 0, targets: tuple[str, ...] = ()
                  ) -> tuple[Tensor, ...]:
    """(shape, logical axes, always-fp32) of every param of ``part`` of the model ``mc``
    builds, read off the model itself (``nnx.eval_shape``: no weights are made), so the plan
    follows the code's layout: ``policy`` (``Transformer``), ``value`` (``ValueModel``),
    ``value_head`` (its params outside the backbone), ``lora`` (the adapters ``add_lora``
    attaches for ``rank`` and ``targets``). Always-fp32: float32 in a bfloat16 model."""
    from flax import nnx

    from tppo_jax.models.lora import LoraSpec, add_lora
    from tppo_jax.models.transformer import Transformer
    from tppo_jax.models.value import ValueModel

    mc = replace(mc, dtype="bfloat16")
    if part == "lora":
        def make():
            return add_lora(Transformer(mc, rngs=nnx.Rngs(0)), LoraSpec(rank, rank, targets))
    else:
        cls = Transformer if part == "policy" else ValueModel

        def make():
            return cls(mc, rngs=nnx.Rngs(0))
    state = nnx.state(nnx.eval_shape(make), nnx.Param)
    flat = jax.tree_util.tree_flatten_with_path(
        state, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]
    out = []
    for path, var in flat:
        keys = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
        if part == "lora" and not isinstance(var, nnx.LoRAParam):
            continue
        if part == "value_head" and keys[0] == "backbone":
            continue
        axes = var.get_metadata().get("out_sharding") or (None,) * len(var.shape)
        out.append((tuple(var.shape), tuple(axes), var.get_value().dtype == jnp.float32))
    return tuple(out)


def _a(name: str, v: int, h: int, i: int, n: int, hq: int, hkv: int, d: int, bias: bool,
       tied: bool) -> Arch:
    return Arch(name, v, h, i, n, hq, hkv, d, bias, tied)


# Sizes from each model's HF config.json.
ARCHITECTURES: dict[str, Arch] = {a.name: a for a in [
    _a("qwen2.5-0.5b", 151936, 896, 4864, 24, 14, 2, 64, True, True),
    _a("qwen2.5-1.5b", 151936, 1536, 8960, 28, 12, 2, 128, True, True),
    _a("qwen2.5-7b", 152064, 3584, 18944, 28, 28, 4, 128, True, False),
    _a("qwen2.5-32b", 152064, 5120, 27648, 64, 40, 8, 128, True, False),
    _a("llama-3-8b", 128256, 4096, 14336, 32, 32, 8, 128, False, False),
    _a("llama-3-70b", 128256, 8192, 28672, 80, 64, 8, 128, False, False),
]}


def _norm_name(text: str) -> str:
    """An architecture's key in ``ARCHITECTURES``: instruct / chat tunes share their base's
    shapes (``Qwen2.5-1.5B-Instruct`` -> ``qwen2.5-1.5b``)."""
    t = text.lower().replace("_", "-").replace("meta-", "")
    t = t.replace("llama3", "llama-3").replace("qwen2-5", "qwen2.5")
    for tune in ("-instruct", "-chat", "-base"):
        t = t.removesuffix(tune)
    return t


def resolve_arch(cfg: Config, arch: str | None = None) -> Arch:
    """``arch`` by name; else the tiny model's sizes; else ``model.path``'s folder or Hub repo
    name (e.g. ``gs://b/Qwen2.5-32B``, ``Qwen/Qwen2.5-32B``) or its local ``config.json``."""
    if arch is not None:
        key = _norm_name(arch)
        if key not in ARCHITECTURES:
            raise ConfigError(f"unknown --arch {arch!r}; known: {', '.join(ARCHITECTURES)}")
        return ARCHITECTURES[key]
    m = cfg.model
    if m.source == "tiny":
        # warmstart.tiny_model_config: tied embeddings, no bias, 128-piece tokenizer.
        return Arch("tiny", 128, m.hidden_size, m.intermediate_size, m.num_layers, m.num_heads,
                    m.num_kv_heads, m.hidden_size // m.num_heads, False, True)
    path = m.path or ""
    # A Hub id names its repo before any @revision: Qwen/Qwen2.5-32B@main -> Qwen2.5-32B
    key = _norm_name(path.partition("@")[0].rstrip("/").rsplit("/", 1)[-1])
    if key in ARCHITECTURES:
        return ARCHITECTURES[key]
    local = Path(path) / "config.json"
    if not path.startswith("gs://") and local.exists():
        import json

        from tppo_jax.models.hf import config_from_hf

        c = config_from_hf(json.loads(local.read_text()))
        return Arch(Path(path).name, c.vocab_size, c.hidden_size, c.intermediate_size,
                    c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.qkv_bias,
                    c.tie_embeddings)
    raise ConfigError(f"cannot tell the architecture of model.path {path!r}; pass --arch "
                      f"(one of {', '.join(ARCHITECTURES)})")


def resolve_mesh(cfg: Config, chips: int) -> dict[str, int]:
    """``mesh.data/fsdp/tensor`` with ``-1`` filled in; must multiply to ``chips``."""
    sizes = {"data": cfg.mesh.data, "fsdp": cfg.mesh.fsdp, "tensor": cfg.mesh.tensor}
    free = [k for k, v in sizes.items() if v == -1]
    known = math.prod(v for v in sizes.values() if v != -1)
    if len(free) > 1 or known <= 0 or any(v < -1 or v == 0 for v in sizes.values()):
        raise ConfigError(f"mesh {sizes}: sizes must be positive, at most one -1")
    if free:
        if chips % known:
            raise ConfigError(f"mesh {sizes} does not divide {chips} chips")
        sizes[free[0]] = chips // known
    if math.prod(sizes.values()) != chips:
        raise ConfigError(f"mesh data*fsdp*tensor = {math.prod(sizes.values())} ({sizes}) "
                          f"but the slice has {chips} chips")
    return sizes


def local_elements(shape: tuple[int, ...], axes: tuple[str | None, ...],
                   mesh: dict[str, int]) -> int:
    """Elements of one device's shard: each dim split over its rule's mesh axes, skipping an
    axis that does not divide (``parallel.mesh._fits``); a mesh axis is used once."""
    used: set[str] = set()
    n = 1
    for dim, name in zip(shape, axes, strict=True):
        split = 1
        target = LOGICAL_RULES.get(name) if name is not None else None
        for ax in (target,) if isinstance(target, str) else tuple(target or ()):
            if ax in used:
                continue
            used.add(ax)
            if dim % (split * mesh[ax]) == 0:
                split *= mesh[ax]
        n *= dim // split
    return n


def _model_rows(tensors, mesh: dict[str, int], dtype_bytes: int,
                frozen=(), masters: bool = True) -> dict[str, int]:
    """Per-chip bytes of a model: ``tensors`` train (params, gradients, AdamW states);
    ``frozen`` ones (a LoRA base) are params only. ``masters``: float32 masters and moments
    of low-precision params (``model.param_dtype: float32``), else moments in their dtype."""
    params = grads = opt = 0
    for shape, axes, fp32 in frozen:
        params += local_elements(shape, axes, mesh) * (4 if fp32 else dtype_bytes)
    for shape, axes, fp32 in tensors:
        n = local_elements(shape, axes, mesh)
        b = 4 if fp32 else dtype_bytes
        params += n * b
        grads += n * b
        # AdamW m + v in fp32 plus an fp32 master copy of low-precision params, or m + v
        # in the params' own dtype (pure bf16)
        opt += n * (8 + (4 if b < 4 else 0)) if masters else n * 2 * b
    return {"params": params, "optimizer": opt, "grads": grads}


def _models_rows(cfg: Config, a: Arch, mesh: dict[str, int], dtype_bytes: int
                 ) -> tuple[dict[str, int], dict[str, int], dict[str, Any] | None]:
    """``(policy rows, value rows, LoRA summary or None)`` (``_model_rows`` of each model)."""
    m = cfg.model
    rows = partial(_model_rows, mesh=mesh, dtype_bytes=dtype_bytes,
                   masters=m.param_dtype == "float32")
    if not m.lora_rank:
        return rows(a.policy_tensors()), rows(a.value_tensors()), None
    targets = parse_lora_targets(m.lora_targets)
    adapters = list(a.lora_tensors(m.lora_rank, targets))
    policy = rows(adapters, frozen=a.policy_tensors())
    shared = m.value_lora and m.value_init == "policy"  # weights/params.py shares_base
    if m.value_lora:
        # The frozen backbone: all but the fp32 head; none of its own when shared
        backbone = [] if shared else [t for t in a.value_tensors() if not t[2]]
        value = rows([*adapters, *a.value_head_tensors()], frozen=backbone)
    else:
        value = rows(a.value_tensors())
    n = sum(math.prod(s) for s, _, _ in adapters)
    return policy, value, {"rank": m.lora_rank, "targets": list(targets),
                           "adapter_params": n, "value_lora": m.value_lora,
                           "shared_base": shared}


def plan_memory(cfg: Config, tpu: TpuType | str, arch: Arch | str | None = None
                ) -> dict[str, Any]:
    """Per-chip bytes of every component and whether the total fits the chip's HBM."""
    tpu = parse_tpu_type(tpu) if isinstance(tpu, str) else tpu
    a = arch if isinstance(arch, Arch) else resolve_arch(cfg, arch)
    mesh = resolve_mesh(cfg, tpu.chips)
    r, bytes_ = cfg.rollout, DTYPE_BYTES[cfg.model.dtype]
    dp = mesh["data"] * mesh["fsdp"]

    policy, value, lora = _models_rows(cfg, a, mesh, bytes_)

    seq = r.max_len
    mb_seqs = r.slots // cfg.optim.minibatches
    seqs_per_chip = -(-mb_seqs // dp)
    tokens = seqs_per_chip * seq
    h, i, hq, hkv, d = (a.hidden_size, a.intermediate_size, a.num_heads, a.num_kv_heads,
                        a.head_dim)
    t = mesh["tensor"]
    # heads/mlp split over tensor only where they divide (as the weights are).
    hq_l = hq // t if hq % t == 0 else hq
    hkv_l = hkv // t if hkv % t == 0 else hkv
    i_l = i // t if i % t == 0 else i
    boundaries = tokens * h * bytes_ * a.num_layers
    # x, norm(x), residual, mlp-norm: 4H; q, k, v, attn-out; gate, up, silu*up; x2 cotangents.
    per_token = 4 * h + (2 * hq_l + 2 * hkv_l) * d + 3 * i_l
    working = 2 * tokens * per_token * bytes_
    dense_scores = seqs_per_chip * hq_l * seq * seq * 4

    per_slot = -(-seq // r.page_size) * r.page_size
    kv_tokens = r.num_pages * r.page_size if r.num_pages else r.slots * per_slot
    kv_token_bytes = a.num_layers * 2 * hkv * d * bytes_
    kv_heads_split = t if hkv % t == 0 else 1
    kv = -(-kv_tokens // dp) * kv_token_bytes // kv_heads_split

    rows = {
        "policy params": policy["params"], "policy optimizer": policy["optimizer"],
        "policy grads": policy["grads"], "value params": value["params"],
        "value optimizer": value["optimizer"], "value grads": value["grads"],
        "activations (remat boundaries)": boundaries,
        "activations (one layer working set)": working,
        "KV pages": kv,
    }
    total = sum(rows.values())
    fixed = total - kv
    # The KV budget left after everything else, as pages (what rollout.num_pages could be).
    kv_budget = max(tpu.hbm_bytes - fixed, 0)
    max_pages = kv_budget * kv_heads_split // kv_token_bytes * dp // r.page_size
    return {
        "arch": asdict(a), "n_params_policy": a.n_params, "n_params_value": a.n_value_params,
        "tpu": tpu.name, "chips": tpu.chips, "hosts": tpu.hosts, "hbm_bytes": tpu.hbm_bytes,
        "mesh": mesh, "dtype": cfg.model.dtype, "lora": lora,
        "param_shards": mesh["fsdp"] * mesh["tensor"],
        "tokens_per_chip": tokens, "minibatch_seqs": mb_seqs, "seq_len": seq,
        "kv_tokens": kv_tokens, "kv_bytes_per_token": kv_token_bytes,
        "rows": rows, "total_bytes": total, "fits": total <= tpu.hbm_bytes,
        "headroom_bytes": tpu.hbm_bytes - total,
        "max_num_pages": max_pages,
        "notes": {"dense_attention_scores_bytes": dense_scores},
    }


def _gib(b: float) -> str:
    return f"{b / GIB:,.2f} GiB"


# The arithmetic plan against the TPU compiler on the shipped configs (results/compiled_*.json,
# launch/README.md's table; tests/test_docs.py holds both to these): the compiled worst
# program's per-chip residency over this plan's total, lowest and highest. Neither bound holds:
# the compiler's rollout programs keep buffers (decode state, KV pages over the whole pool)
# that the arithmetic does not count, and its update programs need less than the arithmetic's
# activations.
SHIPPED_RATIO = (0.85, 4.62)
RESULTS = Path(__file__).resolve().parent.parent / "results"  # a checkout's measurements


def compiled_match(p: dict[str, Any], config_name: str) -> tuple[Path, dict[str, Any]] | None:
    """``(file, report)`` of the compiled plan in ``results/`` made for this plan's config,
    slice, mesh, lengths and LoRA rank (``tppo plan --compile --out``), or None."""
    rank = p["lora"]["rank"] if p["lora"] else 0
    for f in sorted(RESULTS.glob("compiled_*.json")):
        try:
            d = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        if (d.get("config") == config_name and d.get("topology") == p["tpu"]
                and d.get("mesh") == p["mesh"] and d.get("seq_len") == p["seq_len"]
                and d.get("model", {}).get("lora_rank") == rank and d.get("programs")
                and d.get("live") is not None):
            return f, d
    return None


def compiled_lines(p: dict[str, Any], config_name: str = "") -> list[str]:
    """What to trust: the compiled plan, how far apart the two were on the shipped configs,
    and the compiled figure of this very config when ``results/`` holds it."""
    lo, hi = SHIPPED_RATIO
    lines = [f"an estimate: the compiled plan (--compile: the TPU compiler's own buffers) is the "
             f"one to trust; on the shipped configs its worst program held {lo:.2f}x to "
             f"{hi:.2f}x this total (launch/README.md)"]
    found = compiled_match(p, config_name) if config_name else None
    if found is not None:
        f, d = found
        worst = max(d["programs"], key=lambda r: r.get("resident", 0))
        lines.append(f"compiled ({f.parent.name}/{f.name}, libtpu {d.get('libtpu')}): "
                     f"{worst['name']} {_gib(worst['resident'])} of {_gib(d['hbm_per_chip'])} "
                     f"per chip, {worst['resident'] / p['total_bytes']:.2f}x this total")
    return lines


def shipped_comparison() -> list[dict[str, Any]]:
    """The arithmetic plan beside every compiled plan in ``results/`` (``compiled_*.json``
    with a memory report): one row per file, for launch/README.md's table and
    ``SHIPPED_RATIO``."""
    from tppo_jax.config import load_config

    rows = []
    for f in sorted(RESULTS.glob("compiled_*.json")):
        d = json.loads(f.read_text())
        if not d.get("live") or not d.get("programs"):
            continue  # the per-layer unit costs: no memory report
        rank = d["model"]["lora_rank"]
        overrides = [f"model.lora_rank={rank}"] if rank else []
        p = plan_memory(load_config(d["config"], overrides), d["topology"])
        worst = max(d["programs"], key=lambda r: r.get("resident", 0))
        rows.append({"file": f.name, "config": d["config"], "overrides": overrides,
                     "topology": d["topology"], "arithmetic_gib": p["total_bytes"] / GIB,
                     "worst": worst["name"], "compiled_gib": worst["resident"] / GIB,
                     "hbm_gib": d["hbm_per_chip"] / GIB,
                     "ratio": worst["resident"] / p["total_bytes"]})
    return rows


def shipped_table(rows: list[dict[str, Any]] | None = None) -> str:
    """launch/README.md's table of ``shipped_comparison`` (markdown)."""
    out = ["| config | slice | arithmetic (`tppo plan`) | compiled worst program (`--compile`) "
           "| compiled / arithmetic |", "|---|---|---|---|---|"]
    for r in rows if rows is not None else shipped_comparison():
        name = " ".join([f"`{r['config']}`", *(f"`{o}`" for o in r["overrides"])])
        out.append(f"| {name} | {r['topology']} | {r['arithmetic_gib']:.2f} GiB | "
                   f"`{r['worst']}` {r['compiled_gib']:.2f} of {r['hbm_gib']:.2f} GiB | "
                   f"{r['ratio']:.2f}x |")
    return "\n".join(out)


def format_plan(p: dict[str, Any], config_name: str = "") -> str:
    """The plan as a fixed-width table with a verdict and hints (``config_name``: the
    compiled figure of that config from ``results/`` when there is one)."""
    m, a = p["mesh"], p["arch"]
    lines = [
        f"{a['name']} ({p['n_params_policy'] / 1e9:.2f}B params, {p['dtype']}) on {p['tpu']}: "
        f"{p['chips']} chips, {p['hosts']} hosts, {_gib(p['hbm_bytes'])} HBM per chip",
        " ".join(f"{k}={m[k]}" for k in MESH_AXES)
        + f"; mini-batch {p['minibatch_seqs']} x {p['seq_len']} tokens -> "
          f"{p['tokens_per_chip']:,} tokens per chip; KV {p['kv_tokens']:,} tokens",
        "",
        *_lora_line(p),
        f"{'component':<40}{'per chip':>16}",
        "-" * 56,
    ]
    lines += [f"{k:<40}{_gib(v):>16}" for k, v in p["rows"].items()]
    lines += ["-" * 56, f"{'total':<40}{_gib(p['total_bytes']):>16}",
              f"{'HBM':<40}{_gib(p['hbm_bytes']):>16}"]
    verdict = ("fits" if p["fits"] else "DOES NOT FIT") + (
        f" ({_gib(abs(p['headroom_bytes']))} {'free' if p['fits'] else 'over'})")
    lines.append(f"{'verdict':<40}{verdict:>16}")
    lines.append("")
    lines.append(f"KV pages that fit next to the rest: rollout.num_pages <= {p['max_num_pages']:,}"
                 f" (this plan: {p['kv_tokens']:,} tokens; 0 reserves every slot's full "
                 f"length)")
    lines.append(f"not in the total: dense attention scores would add "
                 f"{_gib(p['notes']['dense_attention_scores_bytes'])} per chip "
                 f"(the total assumes a flash/splash attention kernel)")
    lines += compiled_lines(p, config_name)
    return "\n".join(lines)


def _lora_line(p: dict[str, Any]) -> list[str]:
    lo = p["lora"]
    if lo is None:
        return []
    who = ("policy and critic (+ its value head)" if lo["value_lora"]
           else "policy (the critic trains in full)")
    shared = ("; the critic's frozen backbone is the policy's (value params: adapters + head)"
              if lo["shared_base"] else "")
    return [f"LoRA rank {lo['rank']} on {','.join(lo['targets'])}: "
            f"{lo['adapter_params'] / 1e6:.1f}M adapter params per model; AdamW states and "
            f"gradients only for them in the {who}{shared}", ""]

