"""The `placement` console script; each subcommand registers itself from its own module.

Only argparse and the subcommands' parsers load at import, so `--help` and argument errors answer at once.
Exit codes: 0 success, 2 bad input, 1 internal error, 130 Ctrl-C. Errors are one line in flag names, never a
traceback unless `--debug` or PLACEMENT_DEBUG=1; a reader that stops early (`| head`) ends it quietly with 0."""

from __future__ import annotations

import argparse
import os
import sys
import traceback

from . import calibrate, demo, inspect, plan, run
from .args import ForgivingArgumentParser


def build_parser() -> argparse.ArgumentParser:
    parser = ForgivingArgumentParser(
        prog="placement",
        description="Place the models of a multi-model PyTorch pipeline across GPUs, the CPU and the disk.",
    )
    parser.add_argument("--version", action="version", version=f"placement {_version()}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in (demo, plan, inspect, run, calibrate):
        module.register(subparsers)
    for command in (parser, *subparsers.choices.values()):
        # Read by main() wherever it is on the command line; declared so that every --help lists it.
        command.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    return parser


DEBUG_HELP = "on an error, print the traceback too (also PLACEMENT_DEBUG=1)"


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pipeline-placement")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


EXIT_BAD_INPUT = 2
EXIT_INTERNAL_ERROR = 1
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report a command stopped by Ctrl-C
KEPT_BY_RUN = " (the images already written are kept; only the missing ones are made)"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv or os.environ.get("PLACEMENT_DEBUG", "") not in ("", "0")
    argv = [arg for arg in argv if arg != "--debug"]
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "run", None) is None:
        parser.print_help()
        return 0 if args.command is None else EXIT_BAD_INPUT
    try:
        code = int(args.run(args) or 0)
        sys.stdout.flush()  # here, so that a reader gone away is seen now, not in the interpreter's last flush
        return code
    except BrokenPipeError:
        return _reader_gone()
    except KeyboardInterrupt as interrupt:  # a command that stopped cleanly says how far it got
        # A bare Ctrl-C (during imports, planning or loading) carries no message: say what stopped instead.
        said = str(interrupt) or ("interrupted (Ctrl-C) before it finished; run the same command again"
                                  + (KEPT_BY_RUN if args.command == "run" else ""))
        print(f"placement {args.command}: {said}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as error:  # noqa: BLE001 - the one place that turns any failure into an exit code
        if debug:
            traceback.print_exc()
        code, line = describe_failure(error)
        print(f"placement {args.command}: error: {line}", file=sys.stderr)
        return code


def _reader_gone() -> int:
    """stdout's reader closed the pipe (`| head`): stop quietly, stdout pointed at /dev/null so the final flush
    does not fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout is not a file descriptor (e.g. captured by a test)
        pass
    return 0


def describe_failure(error: Exception) -> tuple[int, str]:
    from placement.errors import PlacementError  # imports torch: only once a command has run

    from .targets import in_flag_names

    message = " ".join(str(error).split())
    if isinstance(error, PlacementError):  # a typed, explained error: the message is the whole story
        return EXIT_BAD_INPUT, in_flag_names(message)
    if isinstance(error, OSError):  # a path that cannot be read or written: the user can fix it
        where = f" {error.filename!r}" if error.filename else ""
        return EXIT_BAD_INPUT, f"cannot access{where}: {error.strerror or message}. Check the path and permissions."
    return EXIT_INTERNAL_ERROR, (
        f"internal error ({type(error).__name__}: {message}). Run again with --debug for the traceback, and report "
        "it if the input looks right."
    )


if __name__ == "__main__":
    sys.exit(main())
