"""``tppo`` command line. Each subcommand lives in the module that owns the work;
this file only parses arguments and turns expected errors into one-line messages."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from tppo_jax.config import ConfigError, load_config


def add_config_args(p: argparse.ArgumentParser) -> None:
    """``--config FILE`` and ``key=value`` overrides, shared by every config-driven command."""
    p.add_argument("--config", default=None,
                   help="YAML file or shipped config name (default: the embedded default)")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="config overrides, e.g. rollout.window=64 train.steps=10")


def cmd_config(args: argparse.Namespace) -> int:
    """Print the resolved config (after overrides and validation) as YAML."""
    cfg = load_config(args.config, args.overrides)
    print(cfg.to_yaml(), end="")
    return 0


COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None],
                          Callable[[argparse.Namespace], int]]] = {}


def register(name: str, help_text: str, add_args: Callable[[argparse.ArgumentParser], None],
             run: Callable[[argparse.Namespace], int]) -> None:
    COMMANDS[name] = (help_text, add_args, run)


register("config", "print the resolved, validated config", add_config_args, cmd_config)


def _register_optional() -> None:
    """Subcommands whose modules exist; imported lazily so `tppo --help` stays fast."""
    from tppo_jax import commands

    commands.register_all(register)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tppo",
        description="Truncated PPO (T-PPO) and VAPO for reasoning LLMs, in JAX/Flax NNX.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (help_text, add_args, run) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        add_args(p)
        p.set_defaults(_run=run)
    return parser


def main(argv: list[str] | None = None) -> int:
    _register_optional()
    parser = build_parser()
    args = parser.parse_args(argv)
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


if __name__ == "__main__":
    sys.exit(main())
