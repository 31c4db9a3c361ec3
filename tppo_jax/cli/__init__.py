"""``tppo`` command line: one ``main``, one subcommand table.

Each command group is one module of this package (``train``, ``runs``: data / plot / eval /
export / convert, ``serve``: serve / generate, ``launch``: launch / plan, ``bench``), with a
``register(register_fn)`` that adds its subcommands; they import the layers below lazily so
``tppo --help`` stays fast. This module parses arguments and turns expected errors into
one-line messages."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from tppo_jax.cli.args import add_config_args
from tppo_jax.config import ConfigError, load_config

__all__ = ["COMMANDS", "add_config_args", "build_parser", "main", "register"]


def cmd_config(args: argparse.Namespace) -> int:
    """Print the resolved config (after overrides and validation) as YAML."""
    from tppo_jax.learner.estimators import resolve_estimator
    from tppo_jax.rewards.custom import check_reward

    cfg = load_config(args.config, args.overrides)
    resolve_estimator(cfg.algo.advantage_baseline)  # a package.module:function imported
    check_reward(cfg.reward)  # reward.fn imported and called once on a sample row
    print(cfg.to_yaml(), end="")
    return 0


COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None],
                          Callable[[argparse.Namespace], int]]] = {}


def register(name: str, help_text: str, add_args: Callable[[argparse.ArgumentParser], None],
             run: Callable[[argparse.Namespace], int]) -> None:
    COMMANDS[name] = (help_text, add_args, run)


register("config", "print the resolved, validated config", add_config_args, cmd_config)


GROUPS = ("train", "runs", "serve", "launch", "bench")  # tppo_jax.cli.<group>, in help order


def _register_optional() -> None:
    """Every group's subcommands (imported here, not at the top, so the table is built only
    when ``main`` runs)."""
    import importlib

    for group in GROUPS:
        importlib.import_module(f"tppo_jax.cli.{group}").register(register)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tppo",
        description="Truncated PPO (T-PPO) and VAPO for reasoning LLMs, in JAX/Flax NNX.",
    )
    from tppo_jax.version import version

    parser.add_argument("--version", action="version", version=f"tppo-jax {version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (help_text, add_args, run) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        add_args(p)
        p.set_defaults(_run=run)
    return parser


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``parser.parse_args``, with ``key=value`` overrides accepted anywhere, after options
    too (argparse fills a positional list once, from the first run of positionals)."""
    args, extra = parser.parse_known_args(argv)
    takes = isinstance(getattr(args, "overrides", None), list)
    bad = [a for a in extra if not takes or a.startswith("-") or "=" not in a]
    if bad:
        parser.error(f"unrecognized arguments: {' '.join(bad)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    return args


def main(argv: list[str] | None = None) -> int:
    from tppo_jax.backend_env import cpu_only_where_nothing_else

    cpu_only_where_nothing_else()  # no libtpu start-up noise where there is no TPU
    _register_optional()
    parser = build_parser()
    args = parse_args(parser, argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 0
    try:
        return int(args._run(args) or 0)
    except ConfigError as e:
        print(f"tppo {args.command}: config error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # data errors name file:line; anything else propagates
        from tppo_jax.data.readers import DataError

        if not isinstance(e, DataError):
            raise
        print(f"tppo {args.command}: data error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"tppo {args.command}: interrupted", file=sys.stderr)
        return 130

