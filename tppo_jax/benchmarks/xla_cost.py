"""CPU-checkable speed proxies from XLA's compiler: cost, memory and buffer-copy structure.

Any jitted callable can be analysed without running it (``lower(...).compile()`` only):

- ``cost(compiled)``: FLOPs and bytes accessed (``compiled.cost_analysis()``) and the memory
  plan (``compiled.memory_analysis()``: argument / output / aliased / temp bytes).
- ``parse_hlo(text)``: the optimized HLO (``compiled.as_text()``) as computations of
  instructions, enough to find which buffers a step *writes*.
- ``big_writes(module, dims)``: instructions that materialise a buffer holding a whole
  ``dims``-shaped tensor (e.g. one layer's KV cache) -- copies, transposes, slices, non in-place
  updates -- split into those inside a ``while`` loop (paid every decode step) and those
  outside (paid once per call). In-place updates (a ``dynamic-update-slice`` or ``scatter``
  whose result replaces its operand buffer) are not writes of the whole buffer: XLA inserts an
  explicit ``copy`` of the operand when it cannot update in place, and that copy is reported.

Two XLA accounting facts the callers rely on (checked by ``tests/benchmarks/test_xla_cost.py``):
``HloCostAnalysis`` counts a ``while`` body once, whatever its trip count, so the cost of a
jitted window decode is one decode step plus what runs once per window; and it charges a
``scatter`` its whole operand and result even when the update happens in place (a
``dynamic-update-slice`` is charged its update only), so ``inplace_scatter_bytes`` reports what
to subtract for the bytes a step really moves.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
                "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
                "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1, "s4": 1, "u4": 1}
_ARRAY = re.compile(r"([a-z]+[0-9a-z]*)\[([0-9,]*)\]")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(\(.*?\)|[a-z0-9]+\[[0-9,]*\]\S*)\s+"
                    r"([a-z][\w\-]*)\((.*)$")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*(\(.*\))?\s*->.*\{\s*$|^(ENTRY\s+)?%?([\w.\-]+)"
                     r"\s*\{\s*$")
_CALLS = re.compile(r"\b(?:calls|body|condition|to_apply)=%?([\w.\-]+)")
_CALL_LISTS = re.compile(r"\b(?:branch_computations|called_computations)=\{([^}]*)\}")
_NO_DATA = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "while",
            "conditional", "call", "after-all", "opt-barrier", "partition-id", "replica-id"}
_UPDATES = {"dynamic-update-slice", "scatter"}


@dataclass
class Instr:
    """One HLO instruction: its result arrays ``[(dtype, dims)]`` (several for a tuple)."""

    name: str
    opcode: str
    arrays: list[tuple[str, tuple[int, ...]]]
    operands: list[str]
    called: list[str]
    is_root: bool

    @property
    def nbytes(self) -> int:
        return sum(_nbytes(dt, dims) for dt, dims in self.arrays)


@dataclass
class Computation:
    name: str
    instrs: list[Instr] = field(default_factory=list)

    @property
    def root(self) -> Instr | None:
        return next((i for i in self.instrs if i.is_root), None)


def _nbytes(dtype: str, dims: tuple[int, ...]) -> int:
    n = _DTYPE_BYTES.get(dtype, 4)
    for d in dims:
        n *= d
    return n


def _parse_instr(line: str) -> Instr | None:
    m = _INSTR.match(line)
    if m is None:
        return None
    root, name, shape, opcode, rest = m.groups()
    arrays = [(dt, tuple(int(x) for x in dims.split(",") if x))
              for dt, dims in _ARRAY.findall(shape)]
    args = rest.split(")", 1)[0]
    operands = re.findall(r"%([\w.\-]+)", args)
    called = _CALLS.findall(rest)
    for group in _CALL_LISTS.findall(rest):
        called += re.findall(r"%?([\w.\-]+)", group)
    return Instr(name, opcode, arrays, operands, called, bool(root))


def parse_hlo(text: str) -> tuple[dict[str, Computation], str]:
    """Optimized HLO text -> ({computation name: Computation}, entry computation name)."""
    comps: dict[str, Computation] = {}
    entry, cur = "", None
    for line in text.splitlines():
        if cur is None:
            h = _HEADER.match(line)
            if h and not line.startswith("HloModule"):
                name = h.group(2) or h.group(5)
                cur = comps.setdefault(name, Computation(name))
                if h.group(1) or h.group(4):
                    entry = name
            continue
        if line.startswith("}"):
            cur = None
            continue
        ins = _parse_instr(line)
        if ins is not None:
            cur.instrs.append(ins)
    return comps, entry


def _effective_root(comps: dict[str, Computation], ins: Instr) -> Instr:
    """The op a fusion computes (its called computation's root, through bitcasts)."""
    if ins.opcode != "fusion" or not ins.called or ins.called[0] not in comps:
        return ins
    comp = comps[ins.called[0]]
    by_name = {i.name: i for i in comp.instrs}
    r = comp.root
    while r is not None and r.opcode == "bitcast" and r.operands and r.operands[0] in by_name:
        r = by_name[r.operands[0]]
    return r or ins


def _scheduled(comps: dict[str, Computation], entry: str) -> dict[str, bool]:
    """Computations whose instructions own buffers (not fusion bodies or reducers), mapped to
    whether they run inside a ``while`` loop."""
    out: dict[str, bool] = {}
    stack = [(entry, False)]
    while stack:
        name, in_loop = stack.pop()
        if name not in comps or out.get(name, False) or (name in out and not in_loop):
            continue
        out[name] = in_loop
        for ins in comps[name].instrs:
            if ins.opcode in ("while", "conditional", "call"):
                stack += [(c, in_loop or ins.opcode == "while") for c in ins.called]
    return out


def _contains(dims: tuple[int, ...], target: tuple[int, ...]) -> bool:
    """True when ``dims`` holds every non-unit axis of ``target`` (as a multiset)."""
    pool = [d for d in dims if d != 1]
    for t in (t for t in target if t != 1):
        if t not in pool:
            return False
        pool.remove(t)
    return True


def big_writes(comps: dict[str, Computation], entry: str,
               dims: tuple[int, ...]) -> dict[str, list[dict]]:
    """Instructions that write a buffer containing a whole ``dims`` tensor, excluding
    in-place updates; ``{"in_loop": [...], "outside_loop": [...]}`` of
    ``{"name", "op", "shape", "bytes"}``."""
    out: dict[str, list[dict]] = {"in_loop": [], "outside_loop": []}
    for cname, in_loop in _scheduled(comps, entry).items():
        for ins in comps[cname].instrs:
            if ins.opcode in _NO_DATA:
                continue
            op = _effective_root(comps, ins)
            upd = _update_of(comps, cname, ins, op)
            small_update = upd is not None and not any(_contains(u, dims) for _, u in upd.arrays)
            for dt, shape in ins.arrays:
                if small_update or not _contains(shape, dims):
                    continue
                out["in_loop" if in_loop else "outside_loop"].append(
                    {"name": ins.name, "op": op.opcode, "shape": list(shape),
                     "bytes": _nbytes(dt, shape)})
    return out


def _update_of(comps: dict[str, Computation], cname: str, ins: Instr, op: Instr) -> Instr | None:
    """The update operand of an in-place ``dynamic-update-slice`` / ``scatter`` (``ins`` itself
    or a fusion rooted at one), or None for any other instruction."""
    if op.opcode not in _UPDATES or len(ins.arrays) != 1:
        return None
    pos = 1 if op.opcode == "dynamic-update-slice" else 2
    fused = comps.get(ins.called[0]) if ins.opcode == "fusion" and ins.called else None
    scope = {i.name: i for i in (fused.instrs if fused else comps[cname].instrs)}
    return scope.get(op.operands[pos]) if len(op.operands) > pos else None


def inplace_scatter_bytes(comps: dict[str, Computation], entry: str) -> int:
    """Bytes ``cost_analysis`` charges in-place scatters beyond their updates (operand +
    result, less twice the update), over the scheduled computations."""
    total = 0
    for cname in _scheduled(comps, entry):
        for ins in comps[cname].instrs:
            op = _effective_root(comps, ins)
            if op.opcode != "scatter" or len(ins.arrays) != 1:
                continue
            upd = _update_of(comps, cname, ins, op)
            total += 2 * ins.nbytes - 2 * (upd.nbytes if upd else 0)
    return total


def cost(compiled: Any) -> dict:
    """FLOPs, bytes accessed and the memory plan of a compiled executable."""
    ca = compiled.cost_analysis()
    ca = (ca[0] if ca else {}) if isinstance(ca, list | tuple) else (ca or {})
    out = {"flops": float(ca.get("flops", 0.0)),
           "bytes_accessed": float(ca.get("bytes accessed", 0.0))}
    mem = compiled.memory_analysis()
    if mem is not None:
        for k in ("argument", "output", "alias", "temp"):
            out[f"{k}_bytes"] = int(getattr(mem, f"{k}_size_in_bytes", 0))
    return out


def compile_fn(fn: Callable, args: Sequence[Any], kwargs: dict | None = None) -> Any:
    """``fn`` must be a ``jax.jit``-ed callable; returns its compiled executable for these
    (concrete or ``ShapeDtypeStruct``) arguments."""
    return fn.lower(*args, **(kwargs or {})).compile()


def decode_report(compiled: Any, *, layer_dims: tuple[int, ...], weight_bytes: int,
                  kv_bytes: int) -> dict:
    """Cost and copy structure of a compiled window decode (a ``while`` loop of decode steps).

    Args:
      compiled: ``compile_fn(jitted_window_decode, args)`` (whatever module the decode lives
        in; nothing is executed).
      layer_dims: shape of one layer's K (or V) cache, e.g. ``(B, S, Hkv, D)``; a buffer
        holding a whole such tensor written inside the loop is a per-step cache copy.
      weight_bytes: bytes of all parameters; kv_bytes: bytes of K and V the attention of one
        step must read (the whole allocated dense cache; the live pages for a paged one).

    Returns: ``{"flops", "bytes_accessed", "bytes_per_step", "bytes_vs_weights_plus_kv",
    "cache_writes_per_step", "cache_writes_per_call", ...memory plan}``; ``bytes_per_step``
    is XLA's count less the in-place scatter overcharge (see the module docstring), and
    includes what runs once per call (prefix/epilogue, cache copy when not donated).
    """
    out = cost(compiled)
    comps, entry = parse_hlo(compiled.as_text())
    writes = big_writes(comps, entry, layer_dims)
    out["bytes_per_step"] = out["bytes_accessed"] - inplace_scatter_bytes(comps, entry)
    out["weight_bytes"], out["kv_bytes"] = int(weight_bytes), int(kv_bytes)
    out["bytes_vs_weights_plus_kv"] = out["bytes_per_step"] / max(weight_bytes + kv_bytes, 1)
    out["cache_writes_per_step"] = writes["in_loop"]
    out["cache_writes_per_call"] = writes["outside_loop"]
    return out


def train_report(compiled: Any, *, n_params: int, tokens: int) -> dict:
    """FLOPs of a compiled train step against the ``6 * N * tokens`` estimate (forward 2N,
    backward 4N per token; attention and recomputation come on top). Loops (``scan``) are
    counted once by XLA, so keep them single-trip when comparing."""
    out = cost(compiled)
    out["six_n_tokens"] = 6.0 * n_params * tokens
    out["flops_vs_6n"] = out["flops"] / out["six_n_tokens"]
    return out
