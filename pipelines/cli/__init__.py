"""The `placement` console script. Each subcommand lives in its own module and registers itself here."""

from __future__ import annotations

import argparse
import sys

from placement.errors import PlacementError

from . import demo, plan, run


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="placement",
        description="Place the models of a multi-model PyTorch pipeline across GPUs, the CPU and the disk.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in (demo, plan, run):
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "run", None) is None:
        parser.print_help()
        return 0 if args.command is None else 2
    try:
        return int(args.run(args) or 0)
    except PlacementError as error:  # a typed, explained error: the message is the whole story
        print(f"placement {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
