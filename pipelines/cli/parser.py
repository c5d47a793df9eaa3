"""The `placement` argument parser: argparse, forgiving the habits of neighbouring tools.

- `--max_memory` works for `--max-memory` (accelerate's and diffusers' scripts spell flags with underscores):
  every `--a_b` is read as `--a-b` when the parser knows that flag. The aliases are not listed in `--help`.
- An unknown flag or subcommand is an error that names the closest known one: "unrecognized argument
  --max-memroy (did you mean --max-memory?)", "unknown command 'pln' (did you mean 'plan'?)".
- An error is one line and a pointer to `--help` (argparse prints its usage block first; here only `--help`
  prints the usage).
- A flag's value that starts with "-" is its value, not a flag: `--max-memory -1=24GiB` reaches the budget
  parser (which says a device id is never negative) instead of "expected one argument".

Imports nothing beyond the standard library: `placement --help` and argument errors answer at once.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from typing import NoReturn, Sequence

_INVALID_CHOICE = re.compile(
    r"argument (?P<argument>\S+): invalid choice: '(?P<given>[^']*)' \(choose from (?P<choices>.*)\)")


class ForgivingArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser (and, through `add_subparsers`, every subcommand's) with the habits above."""

    def parse_known_args(self, args: Sequence[str] | None = None, namespace=None):
        args = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(self._values_attached(self._hyphenated(args)), namespace)

    def parse_args(self, args: Sequence[str] | None = None, namespace=None):
        parsed, unknown = self.parse_known_args(args, namespace)
        if unknown:
            self._command_parser(parsed).error(self._unrecognized(parsed, unknown))
        return parsed

    def error(self, message: str) -> NoReturn:
        choice = _INVALID_CHOICE.search(message)
        if choice is not None:
            known = [name.strip(" '") for name in choice["choices"].split(",")]
            what = "command" if choice["argument"] == "COMMAND" else f"value for {choice['argument']}"
            message = f"unknown {what} {choice['given']!r}{suggestion(choice['given'], known)}; " \
                      f"the choices are {', '.join(known)}"
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")

    def _values_attached(self, args: list[str]) -> list[str]:
        """`--flag -value` as `--flag=-value` where `--flag` takes one value and `-value` is no flag of this
        parser (argparse reads only plain negative numbers as values)."""
        takes_one = {option for action in self._actions if action.nargs is None for option in action.option_strings}
        known = set(self._option_strings())
        fixed: list[str] = []
        position = 0
        while position < len(args):
            arg, following = args[position], args[position + 1] if position + 1 < len(args) else ""
            if arg == "--":
                return fixed + args[position:]
            if arg in takes_one and following.startswith("-") and not following.startswith("--") \
                    and following != "-" and following.partition("=")[0] not in known:
                fixed.append(f"{arg}={following}")
                position += 2
                continue
            fixed.append(arg)
            position += 1
        return fixed

    def _hyphenated(self, args: list[str]) -> list[str]:
        """`--a_b[=value]` as `--a-b[=value]` where this parser knows `--a-b` (or a flag it abbreviates);
        everything after a bare `--` is left as it is."""
        known = self._option_strings()
        fixed: list[str] = []
        for position, arg in enumerate(args):
            if arg == "--":
                return fixed + args[position:]
            name, separator, value = arg.partition("=")
            if name.startswith("--") and "_" in name:
                spelled = "--" + name[2:].replace("_", "-")
                if any(option.startswith(spelled) for option in known):
                    arg = spelled + separator + value
            fixed.append(arg)
        return fixed

    def _option_strings(self) -> list[str]:
        return [option for action in self._actions for option in action.option_strings]

    def _command_parser(self, parsed: argparse.Namespace) -> argparse.ArgumentParser:
        """The subcommand's parser when one was chosen (its usage line is the one to show), else this one."""
        return getattr(parsed, "parser", None) or self

    def _unrecognized(self, parsed: argparse.Namespace, unknown: list[str]) -> str:
        known = self._command_parser(parsed)._option_strings()
        described = []
        for arg in unknown:
            name = arg.partition("=")[0]
            hint = suggestion(name, known) if name.startswith("-") else ""
            described.append(f"{arg}{hint}")
        noun = "argument" if len(unknown) == 1 else "arguments"
        return f"unrecognized {noun}: " + ", ".join(described)


def suggestion(given: str, known: Sequence[str]) -> str:
    """" (did you mean --max-memory?)" for the closest of `known`, or ""."""
    close = difflib.get_close_matches(given.replace("_", "-"), list(known), n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""

