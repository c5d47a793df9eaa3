"""The `placement` console script. Each subcommand lives in its own module and registers itself here.

Nothing is imported at module level beyond argparse and the subcommands' parsers (which import neither torch
nor `placement`): `placement --help` and argument errors answer at once; a command imports what it runs."""

from __future__ import annotations

import argparse
import sys

from . import demo, inspect, plan


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="placement",
        description="Place the models of a multi-model PyTorch pipeline across GPUs, the CPU and the disk.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in (demo, plan, inspect):
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "run", None) is None:
        parser.print_help()
        return 0 if args.command is None else 2
    from placement.errors import PlacementError  # imports torch: only once a command runs

    from .resolve import in_flag_names

    try:
        return int(args.run(args) or 0)
    except PlacementError as error:  # a typed, explained error: the message is the whole story
        print(f"placement {args.command}: error: {in_flag_names(str(error))}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
