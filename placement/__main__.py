"""`python -m placement ...`: the command lives in `pipelines.cli`, which `placement` must never import, so this
replaces the process with `python -m pipelines.cli ...` (same interpreter, arguments and environment)."""

import os
import subprocess
import sys


def main() -> None:
    command = [sys.executable, "-m", "pipelines.cli", *sys.argv[1:]]
    if os.name == "nt":  # Windows' exec starts a new process and returns at once: wait for it instead
        sys.exit(subprocess.call(command))
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, command)


if __name__ == "__main__":
    main()
