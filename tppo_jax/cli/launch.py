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
        render,
        run_steps,
        validate_name,
    )
    from tppo_jax.plan import resolve_mesh

    try:
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
        if args.dry_run:
            print(render(spec, steps), end="")
            return 0
        timeout = args.wait_timeout or (86400.0 if queued else 3600.0)
        return run_steps(spec, steps, wait_timeout_s=timeout)
    except LaunchError as e:
        print(f"tppo launch: {e}", file=sys.stderr)
        return 2


def _plan_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="config file or shipped config name")
    p.add_argument("--topology", required=True, help="TPU type, e.g. v5p-512")
    p.add_argument("--arch", default=None,
                   help="architecture (default: from model.path), e.g. qwen2.5-32b")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")


def cmd_plan(args: argparse.Namespace) -> int:
    """Prints the per-chip memory table (or JSON); exit 0 whether or not it fits."""
    from tppo_jax.config import load_config
    from tppo_jax.launch import LaunchError
    from tppo_jax.plan import format_plan, plan_memory

    try:
        cfg = load_config(args.config, args.overrides)
        p = plan_memory(cfg, args.topology, args.arch)
    except LaunchError as e:
        print(f"tppo plan: {e}", file=sys.stderr)
        return 2
    print(json.dumps(p, indent=1) if args.json else format_plan(p))
    return 0


def register(register_fn: Callable) -> None:
    """Adds ``launch`` and ``plan`` through ``cli.register``'s signature."""
    register_fn("launch", "run tppo train on a Cloud TPU slice via gcloud (--dry-run prints)",
                _launch_args, cmd_launch)
    register_fn("plan", "per-chip HBM plan (params, optimizer, activations, KV) for a TPU type",
                _plan_args, cmd_plan)
