"""Per-program unit costs at a model's real layer count from two small unrolled compiles.

A 64-layer unrolled compile of a 32B model is far too slow for one CPU; every decoder layer
adds the same FLOPs and bytes to a program, so two compiles of the same programs with ``N1 <
N2`` unrolled layers (``tppo plan CONFIG --topology T --compile --unroll-layers --layers N``)
give each program's cost at the real count ``L`` (the JSONs' ``model.layers``) by a line:

    x(L) = x(N1) + (L - N1) (x(N2) - x(N1)) / (N2 - N1)

for ``flops``, ``bytes_accessed`` and the decode window's ``kv_bytes``. Writes a
compiled-programs JSON (``model.scanned_layers: false``, ``model.extrapolated_from: [N1,
N2]``) that ``tppo bench cost-model --compiled`` reads. Memory figures (peak, resident,
fits) are the small models' and are dropped.

    tppo bench compiled-units /tmp/units_l2.json /tmp/units_l4.json \\
        --out results/compiled_units_paper_qwen25_32b_v5p-512.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# Memory figures of the small compiles: not extrapolated (not the real model's).
MEMORY_KEYS = ("arguments", "outputs", "temporaries", "aliased", "peak", "live_outside",
               "resident", "peak_gib", "resident_gib", "fits_alone", "fits")
COSTS = ("flops", "bytes_accessed", "kv_bytes")  # kv_bytes: the decode window's cache


def _layers(rep: dict, path: str) -> tuple[int, int]:
    m = rep.get("model") or {}
    if m.get("scanned_layers", True):
        raise SystemExit(f"{path}: scanned layers (XLA counts the loop body once); compile "
                         f"with --unroll-layers --layers N")
    if "num_layers_compiled" not in m or "layers" not in m:
        raise SystemExit(f"{path}: no model.num_layers_compiled (compile with --layers N)")
    return int(m["num_layers_compiled"]), int(m["layers"])


def extrapolate(a: dict, b: dict, names: tuple[str, str] = ("a", "b")) -> dict:
    """One compiled-programs report at the real layer count from reports ``a`` and ``b``
    of the same config, topology and programs at two unrolled layer counts."""
    (n1, real), (n2, real2) = _layers(a, names[0]), _layers(b, names[1])
    if n1 > n2:
        (a, n1), (b, n2), names = (b, n2), (a, n1), names[::-1]
    if n1 == n2:
        raise SystemExit(f"both compiles have {n1} layers: need two layer counts")
    if real != real2 or a.get("config") != b.get("config") or \
            a.get("topology") != b.get("topology"):
        raise SystemExit(f"{names[0]} and {names[1]}: not the same config, topology and model")
    progs_b = {p["name"]: p for p in b["programs"] if p.get("compiled", True)}
    programs = []
    for p in a["programs"]:
        q = progs_b.get(p["name"])
        if not p.get("compiled", True) or q is None:
            continue
        rec = {k: v for k, v in p.items() if k not in MEMORY_KEYS and k != "compile_s"}
        for k in (c for c in COSTS if c in p and c in q):
            rec[k] = p[k] + (real - n1) * (q[k] - p[k]) / (n2 - n1)
            rec[f"{k}_per_layer"] = (q[k] - p[k]) / (n2 - n1)
        rec["compile_s"] = {str(n1): p.get("compile_s"), str(n2): q.get("compile_s")}
        programs.append(rec)
    if not programs:
        raise SystemExit(f"{names[0]} and {names[1]}: no compiled program in common")
    skip = {"programs", "live", "live_gib", "fits", "worst", "complete", "not_compiled",
            "compile_s"}
    out = {k: v for k, v in a.items() if k not in skip}
    out["model"] = {**a["model"], "scanned_layers": False, "num_layers_compiled": None,
                    "extrapolated_from": [n1, n2]}
    out["sources"] = list(names)
    out["memory"] = ("not extrapolated: the compiles' peak / resident are the small models'; "
                     "see the scanned compile of the full model")
    out["compile_s"] = {str(n1): a.get("compile_s"), str(n2): b.get("compile_s")}
    out["programs"] = programs
    return out


def run(args: argparse.Namespace) -> dict:
    reps = [json.loads(Path(p).read_text()) for p in (args.small, args.large)]
    out = extrapolate(*reps, names=(args.small, args.large))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    n1, n2 = out["model"]["extrapolated_from"]
    print(f"{out['config']} on {out['topology']}: {out['model']['layers']} layers from "
          f"{n1} and {n2} -> {args.out}")
    for p in out["programs"]:
        print(f"  {p['name']:28s} {p['flops'] / 1e12:10.2f} TFLOP "
              f"{p['bytes_accessed'] / 1e9:10.2f} GB per chip")
    return out


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("small", help="compiled JSON at N1 unrolled layers (--layers N1)")
    p.add_argument("large", help="compiled JSON of the same programs at N2 layers")
    p.add_argument("--out", required=True, help="the extrapolated compiled-programs JSON")
