"""LoRA adapters on the decoder's weight projections (policy and critic).

For a targeted weight ``W`` (``transformer.PROJECTIONS``: q, k, v, o, gate, up, down) the layer
computes ``x.W + (x.A).B * alpha / rank``: ``A`` spans ``W``'s contracted (input) dims plus the
rank, ``B`` the rank plus ``W``'s output dims; e.g. q ``[H, Hq, D]`` gets ``A [H, r]`` and
``B [r, Hq, D]``, o ``[Hq, D, H]`` gets ``A [Hq, D, r]`` and ``B [r, H]``. ``B`` starts at zero,
so a fresh adapter leaves the model's outputs exactly as they were; ``A`` starts uniform in
``+-1/sqrt(fan_in)`` (PEFT's default). Like their bases, adapters are stacked over the decoder
layers (a leading ``[L]`` axis, sliced per layer by the layer scan). Adapters are float32
``nnx.LoRAParam``s (tiny next to the base; AdamW states in float32), cast to the activation
dtype for the matmuls, and carry the logical axes of the base dims they span (the rank axis is
replicated), so ``shard_model`` places them like their base.

The adapters live inside the model (``module.lora``, used by ``transformer.project``): training,
prefill, decode and evaluation run one forward, with the adapter path in it. ``merge_lora`` folds
them into the base weights (export). On the params' pure dicts, adapters are the paths through a
``lora`` key: ``split_trainable`` / ``join_params`` separate them (plus, for the critic, its
value head) from the frozen base, so the updates take gradients and keep optimizer states for
the adapters alone.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from tppo_jax.config_checks import parse_lora_targets
from tppo_jax.models.transformer import PROJECTIONS

ADAPTERS = "lora"  # the module attribute (and pure-dict key) that holds a layer's adapters


@dataclass(frozen=True)
class LoraSpec:
    """Rank, alpha and the targeted projections (names of ``transformer.PROJECTIONS``)."""

    rank: int
    alpha: float
    targets: tuple[str, ...]

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def lora_spec(model_settings: Any) -> LoraSpec | None:
    """The ``LoraSpec`` of a config's ``model`` section; None when ``lora_rank`` is 0."""
    m = model_settings
    if not m.lora_rank:
        return None
    return LoraSpec(m.lora_rank, m.lora_alpha, parse_lora_targets(m.lora_targets))


@dataclass(frozen=True)
class Einsums:
    """An adapter's einsums, derived from its base projection's ``"x,w->out"``."""

    a: str  # x, A -> x.A   e.g. "bth,hr->btr"
    b: str  # x.A, B -> out e.g. "btr,rnd->btnd"
    w: str  # A, B -> a weight-shaped update, e.g. "hr,rnd->hnd"
    contracted: tuple[int, ...]  # the weight's dims A spans
    kept: tuple[int, ...]  # the weight's dims B spans


def adapter_einsums(eq: str) -> Einsums:
    """``Einsums`` of the projection ``eq`` (letters: the activations', then the weight's)."""
    lhs, rest = eq.split(",")
    rhs, out = rest.split("->")
    assert "r" not in eq, eq  # the rank's letter
    contracted = tuple(i for i, c in enumerate(rhs) if c in lhs)
    kept = tuple(i for i, c in enumerate(rhs) if c not in lhs)
    a_sub = "".join(rhs[i] for i in contracted) + "r"
    b_sub = "r" + "".join(rhs[i] for i in kept)
    mid = "".join(c for c in lhs if c not in a_sub) + "r"
    return Einsums(f"{lhs},{a_sub}->{mid}", f"{mid},{b_sub}->{out}", f"{a_sub},{b_sub}->{rhs}",
                   contracted, kept)


class LoraAdapter(nnx.Module):
    """The low-rank update of one projection weight: ``(x.A).B * scale``.

    Made for the stacked decoder layers: ``A [L, *contracted, r]``, ``B [L, r, *kept]`` (the
    leading axis is the base's ``layers`` axis); the layer scan hands each layer its slice,
    which ``__call__`` applies."""

    def __init__(self, base: nnx.Param, eq: str, rank: int, scale: float, keys: jax.Array):
        """``base``: the stacked projection weight ``[L, ...]`` (shape and logical axes);
        ``eq``: its per-layer einsum; ``keys [L]``: one init key per layer."""
        e = adapter_einsums(eq)
        layers, *shape = tuple(base.shape)
        axes = base.get_metadata().get("out_sharding") or (None,) * (len(shape) + 1)
        lead, axes = axes[0], axes[1:]
        a_shape = tuple(shape[i] for i in e.contracted) + (rank,)
        bound = 1.0 / math.sqrt(math.prod(a_shape[:-1]))  # 1/sqrt(fan_in)
        a = jax.vmap(lambda k: jax.random.uniform(k, a_shape, jnp.float32, -bound, bound))(keys)
        b = jnp.zeros((layers, rank, *(shape[i] for i in e.kept)), jnp.float32)
        self.a = nnx.LoRAParam(a, out_sharding=(lead, *(axes[i] for i in e.contracted), None),
                               eager_sharding=False)
        self.b = nnx.LoRAParam(b, out_sharding=(lead, None, *(axes[i] for i in e.kept)),
                               eager_sharding=False)
        self.eqs = e
        self.scale = scale

    def __call__(self, x: jax.Array) -> jax.Array:
        """The update to the projection's output for activations ``x`` (``x``'s dtype); on
        one layer's slice of the adapter (inside the layer scan)."""
        h = jnp.einsum(self.eqs.a, x, self.a[...].astype(x.dtype)) * jnp.asarray(self.scale,
                                                                                  x.dtype)
        return jnp.einsum(self.eqs.b, h, self.b[...].astype(x.dtype))

    def weight_delta(self) -> jax.Array:
        """``scale * A.B`` shaped as the (stacked) base weight (float32)."""
        lhs, out = self.eqs.w.split("->")
        a, b = lhs.split(",")
        return self.scale * jnp.einsum(f"...{a},...{b}->...{out}", self.a[...], self.b[...])


def add_lora(model: nnx.Module, spec: LoraSpec, *, seed: int = 0) -> nnx.Module:
    """Attaches fresh adapters (``B = 0``) for ``spec.targets`` to the stacked decoder layers
    of ``model`` (a ``Transformer`` or ``ValueModel``), in place; returns ``model``. Shard
    after (``shard_model``): the adapters are made on the default device."""
    root = jax.random.key(seed)
    layers = model.backbone.layers
    num_layers = model.config.num_layers
    owners: dict[str, dict[str, LoraAdapter]] = {}
    for j, name in enumerate(spec.targets):
        owner, eq = PROJECTIONS[name]
        keys = jnp.stack([jax.random.fold_in(root, i * len(PROJECTIONS) + j)
                          for i in range(num_layers)])
        base = getattr(getattr(layers, owner), name)
        owners.setdefault(owner, {})[name] = LoraAdapter(base, eq, spec.rank, spec.scale, keys)
    for owner, adapters in owners.items():
        setattr(getattr(layers, owner), ADAPTERS, nnx.Dict(adapters))
    return model


def merge_lora(model: nnx.Module) -> nnx.Module:
    """Folds every adapter into its base weight (``W + scale * A.B``, summed in float32, kept in
    the weight's dtype and sharding) and removes the adapters, in place; returns ``model``,
    now a plain model (what ``save_pretrained`` writes)."""
    layers = model.backbone.layers
    for owner in {o for o, _ in PROJECTIONS.values()}:
        module = getattr(layers, owner)
        if module.lora is None:
            continue
        for name, adapter in module.lora.items():
            w = getattr(module, name)
            old = w.get_value()
            new = (old.astype(jnp.float32) + adapter.weight_delta()).astype(old.dtype)
            w.set_value(jax.device_put(new, old.sharding))
        delattr(module, ADAPTERS)
    return model


# ---- the params' pure dicts: adapters (trainable) vs the frozen base ----------------------

_NONE = object()


def _partition(tree: Any, train: Any, path: tuple) -> tuple[Any, Any]:
    if not isinstance(tree, Mapping):
        return (tree, _NONE) if train(path) else (_NONE, tree)
    a, b = {}, {}
    for k, v in tree.items():
        x, y = _partition(v, train, (*path, k))
        if x is not _NONE:
            a[k] = x
        if y is not _NONE:
            b[k] = y
    return (a or _NONE), (b or _NONE)


def split_trainable(params: Mapping, keep: tuple[str, ...] = ()) -> tuple[dict, dict]:
    """``(trainable, frozen)`` parts of a params pure dict: trainable = every adapter leaf
    (a path through ``lora``) and the top-level entries named in ``keep`` (the critic's
    value head); frozen = the rest. Leaves are shared, not copied."""
    train = lambda path: ADAPTERS in path or path[0] in keep  # noqa: E731
    a, b = _partition(params, train, ())
    return ({} if a is _NONE else a), ({} if b is _NONE else b)


def join_params(a: Any, b: Any) -> Any:
    """The nested dict with the leaves of both ``a`` and ``b`` (``split_trainable``'s
    inverse)."""
    if not isinstance(a, Mapping):
        return a
    out = dict(b)
    for k, v in a.items():
        out[k] = join_params(v, b[k]) if k in b else v
    return out

