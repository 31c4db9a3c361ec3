"""``tppo launch`` (run training on a Cloud TPU slice) and ``tppo plan`` (per-chip memory).

Registered in the ``tppo`` command table by ``register(register_fn)``. Modules are imported
inside the commands so ``tppo --help`` stays fast.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable


def _launch_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True,
                   help="config file (in this repo, or copied over) or shipped config name")
    p.add_argument("--tpu-type", required=True,
                   help="accelerator type: v4-N, v5p-N (N = TensorCores), v5litepod-N, v6e-N")
    p.add_argument("--name", default=None, help="TPU name (default: tppo-<config>-<type>)")
    p.add_argument("--zone", default=None, help="zone (default: one that offers the type)")
    p.add_argument("--project", default=None, help="GCP project (default: gcloud's)")
    p.add_argument("--bucket", default=None,
                   help="gs://BUCKET: run dir BUCKET/runs/NAME, results copied from there")
    p.add_argument("--run-dir", default=None, help="run dir on the workers (overrides --bucket's)")
    p.add_argument("--spot", action="store_true", help="Spot TPUs (preemptible, cheaper)")
    p.add_argument("--queued", action="store_true",
                   help="request a queued resource instead of creating the VM directly")
    p.add_argument("--best-effort", action="store_true",
                   help="queued best-effort capacity (gcloud alpha; implies --queued)")
    p.add_argument("--repo", default=None,
                   help="git URL cloned on the workers (default: copy this checkout)")
    p.add_argument("--resume", action="store_true", help="pass --resume to tppo train")
    p.add_argument("--keep", action="store_true", help="do not delete the TPU at the end")
    p.add_argument("--wait-timeout", type=float, default=None,
                   help="seconds to wait for the TPU (default: 1 h, 24 h when queued)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the commands (a shell script) instead of running them")
    p.add_argument("--force", action="store_true",
                   help="launch even when the config does not fit the slice's HBM")
    p.add_argument("--plan", choices=("compiled", "arithmetic"), default="arithmetic",
                   help="how the fit is checked: the arithmetic plan (default: at once, an "
                        "estimate), or compiled by the TPU compiler (needs libtpu; minutes: "
                        "the widest width buckets, stopping at the first that does not fit)")
    p.add_argument("--compile", action="store_const", const="compiled", dest="plan",
                   help="the same as --plan compiled")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="config overrides passed to tppo train")


def cmd_launch(args: argparse.Namespace) -> int:
    """Validates the config for the slice, then prints or runs the gcloud steps."""
    from tppo_jax.config import load_config, validate
    from tppo_jax.launch import (
        GENERATIONS,
        LaunchError,
        LaunchSpec,
        build_steps,
        default_name,
        parse_tpu_type,
        refuse_control_chars,
        render,
        require_gcloud,
        run_steps,
        validate_name,
    )
    from tppo_jax.plan import resolve_mesh

    try:
        refuse_control_chars(vars(args))  # each lands in the printed or run shell script
        tpu = parse_tpu_type(args.tpu_type)
        # Fail here, not an hour later on the pod: the config must load and its mesh must
        # match the slice's chip count.
        cfg = load_config(args.config, args.overrides)
        validate(cfg, num_devices=tpu.chips)
        resolve_mesh(cfg, tpu.chips)
        if args.bucket and not args.bucket.startswith("gs://"):
            raise LaunchError(f"--bucket must look like gs://BUCKET, got {args.bucket!r}")
        name = validate_name(args.name or default_name(args.config, tpu))
        queued = args.queued or args.best_effort
        spec = LaunchSpec(
            config=args.config, tpu=tpu, name=name,
            zone=args.zone or GENERATIONS[tpu.generation].zone, project=args.project,
            bucket=args.bucket, run_dir=args.run_dir, spot=args.spot, queued=queued,
            best_effort=args.best_effort, repo=args.repo, overrides=tuple(args.overrides),
            resume=args.resume, keep=args.keep)
        steps = build_steps(spec)
        timeout = args.wait_timeout or (86400.0 if queued else 3600.0)
        if not args.dry_run:  # before the compiled plan: a missing gcloud is a quick answer
            require_gcloud()
        # Last, after the cheap checks: the compiled plan takes minutes.
        if not args.force:
            why = fit_refusal(cfg, tpu.name, config_name=args.config, plan=args.plan,
                              say=lambda m: print(f"tppo launch: {m}", file=sys.stderr,
                                                  flush=True))
            if why:
                raise LaunchError(f"{why} (--force launches anyway)")
        if args.dry_run:
            print(render(spec, steps, wait_timeout_s=timeout), end="")
            return 0
        return run_steps(spec, steps, wait_timeout_s=timeout)
    except (LaunchError, ValueError) as e:  # ConfigError, TopologyError: one line
        print(f"tppo launch: {e}", file=sys.stderr)
        return 2


def fit_refusal(cfg, tpu_type: str, *, config_name: str = "", plan: str = "arithmetic",
                say: Callable[[str], None] = lambda m: None) -> str | None:
    """One line saying why ``cfg`` does not fit ``tpu_type``, or None when it fits: the
    arithmetic plan (at once; an estimate), or with ``plan="compiled"`` the TPU compiler's
    (``tppo_jax.compile``: the row-group programs at their widest width bucket, stopping at
    the first program that does not fit; ``say`` hears each program as it starts)."""
    from tppo_jax.launch import GIB
    from tppo_jax.plan import plan_memory
    from tppo_jax.platform import parse_topology, require_tpu_compiler

    name = config_name or "config"
    if plan == "compiled":
        require_tpu_compiler()
        from tppo_jax.compile import compile_plan, refusal

        say(f"fit check: compiling {name}'s programs for {tpu_type} (widest width buckets; "
            f"minutes)")
        report = compile_plan(cfg, parse_topology(tpu_type), stop_early=True, widest=True,
                              config_name=config_name,
                              progress=lambda n: say(f"fit check: compiling {n}"))
        why = refusal(report)
        if why is None:
            say(f"fit check: compiled plan fits: worst {report['worst']}")
        return why
    p = plan_memory(cfg, tpu_type)
    used = f"{p['total_bytes'] / GIB:.2f} GiB per chip of {p['hbm_bytes'] / GIB:.2f} GiB"
    if p["fits"]:
        say(f"fit check: arithmetic plan {used} (an estimate: --compile checks with the TPU "
            f"compiler, which is the one to trust)")
        return None
    return (f"{name} does not fit {tpu_type} (arithmetic plan, an estimate; --compile checks "
            f"with the TPU compiler): {used}")


def _plan_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="config file or shipped config name")
    p.add_argument("--topology", required=True, help="TPU type, e.g. v5p-512")
    p.add_argument("--arch", default=None,
                   help="architecture (default: from model.path), e.g. qwen2.5-32b")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--compile", action="store_true",
                   help="compile every program of a step with the TPU compiler for the "
                        "topology (v5litepod-8, v5p-512 or a grid such as v5e:2x2; needs "
                        "libtpu: pip install -e \".[tpu]\"); exit 0 fits, 1 does not, 2 error")
    p.add_argument("--out", default=None, help="--compile: write the report as JSON here")
    p.add_argument("--programs", default=None,
                   help="--compile: only these kinds, comma-separated (policy_update, "
                        "policy_apply, value_update, value_apply, targets, rollout, eval)")
    p.add_argument("--stop-early", action="store_true",
                   help="--compile: stop at the first program that does not fit")
    p.add_argument("--unroll-layers", action="store_true",
                   help="--compile: unrolled layers, so FLOPs and bytes count every layer "
                        "(XLA counts a scanned layer loop's body once; for "
                        "`tppo bench cost-model --compiled`; compiles take longer)")
    p.add_argument("--layers", type=int, default=None,
                   help="--compile: the model with this many decoder layers (with "
                        "--unroll-layers: unit costs per layer, extrapolated by "
                        "`tppo bench compiled-units`; memory figures are the small model's)")
    p.add_argument("--widest", action="store_true",
                   help="--compile: the row-group programs at the widest width bucket only "
                        "(their peak; a long model's compiles take minutes each)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")


def cmd_plan(args: argparse.Namespace) -> int:
    """Prints the per-chip memory table (or JSON); exit 0 whether or not it fits. With
    ``--compile``: the compiled report; exit 0 fits, 1 does not fit, 2 error."""
    from pathlib import Path

    from tppo_jax.config import ConfigError, load_config
    from tppo_jax.launch import LaunchError
    from tppo_jax.plan import format_plan, plan_memory

    try:
        cfg = load_config(args.config, args.overrides)
        if args.compile:
            return _compile(cfg, args)
        p = plan_memory(cfg, args.topology, args.arch)
    except (LaunchError, ConfigError, ValueError) as e:
        print(f"tppo plan: {e}", file=sys.stderr)
        return 2
    print(json.dumps(p, indent=1) if args.json
          else format_plan(p, config_name=Path(args.config).stem))
    return 0


def _compile(cfg, args: argparse.Namespace) -> int:
    from pathlib import Path

    from tppo_jax.compile import compile_plan, format_report, refusal
    from tppo_jax.platform import parse_topology

    topo = parse_topology(args.topology)
    only = [k.strip() for k in args.programs.split(",")] if args.programs else None
    name = Path(args.config).stem
    report = compile_plan(cfg, topo, only=only, stop_early=args.stop_early,
                          widest=args.widest, config_name=name, out=args.out,
                          unroll_layers=args.unroll_layers, layers=args.layers,
                          progress=lambda n: print(f"compiling {n}", file=sys.stderr,
                                                   flush=True))
    print(json.dumps(report, indent=1) if args.json else format_report(report))
    why = refusal(report)
    if why:
        print(f"tppo plan: {why}", file=sys.stderr)
        return 1
    return 0


def register(register_fn: Callable) -> None:
    """Adds ``launch`` and ``plan`` through ``cli.register``'s signature."""
    register_fn("launch", "run tppo train on a Cloud TPU slice via gcloud (--dry-run prints)",
                _launch_args, cmd_launch)
    register_fn("plan", "per-chip HBM plan (params, optimizer, activations, KV) for a TPU type",
                _plan_args, cmd_plan)
