"""Subcommands backed by the rest of the package; each imports its module lazily."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None,
                   help="YAML file or shipped config name (default: the embedded default)")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="config overrides, e.g. rollout.window=64 train.steps=10")


def _train_args(p: argparse.ArgumentParser) -> None:
    _config_args(p)
    p.add_argument("--run-dir", default=None,
                   help="output directory (default: runs/<config name>)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def cmd_train(args: argparse.Namespace) -> int:
    from tppo_jax.config import load_config
    from tppo_jax.train.trainer import train

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    cfg = load_config(args.config, args.overrides)
    name = Path(args.config).stem if args.config else "default"
    run_dir = Path(args.run_dir or Path("runs") / name)
    summary = train(cfg, run_dir, resume=args.resume, progress=not args.no_progress)
    b, a = summary["eval_before"], summary["eval_after"]
    print(f"held-out accuracy (greedy, {len(a) and 'avg@1'}): before {b['avg@1']:.1f}% -> "
          f"after {a['avg@1']:.1f}%  ({summary['steps']} steps, "
          f"{summary['train_seconds']:.0f} s, run dir {summary['run_dir']})")
    return 0


def _preview_args(p: argparse.ArgumentParser) -> None:
    _config_args(p)
    p.add_argument("-n", type=int, default=3, help="samples to print")


def cmd_data_preview(args: argparse.Namespace) -> int:
    from tppo_jax.config import load_config
    from tppo_jax.data.synthetic import SyntheticMathTask, length_histogram
    from tppo_jax.train.trainer import load_data

    cfg = load_config(args.config, args.overrides)
    train_rows, _, fmt = load_data(cfg)
    for ex in train_rows[: args.n]:
        print(json.dumps({"prompt": fmt(ex), "answer": ex.answer, "solution": ex.solution},
                         indent=1))
    if cfg.data.source == "synthetic":
        task = SyntheticMathTask(seed=cfg.data.seed, difficulty=cfg.data.difficulty)
        texts = task.teacher_corpus(512, 0.0, 0.0)
        print("solution length (characters) over 512 samples:")
        print(length_histogram([len(t.partition("\nA: ")[2]) for t in texts]))
    return 0


def register_all(register: Callable) -> None:
    register("train", "run T-PPO training (no arguments: the embedded CPU default)",
             _train_args, cmd_train)
    register("data", "preview the training data (`tppo data` = preview)", _preview_args,
             cmd_data_preview)


if __name__ == "__main__":
    from tppo_jax.cli import main

    sys.exit(main())
