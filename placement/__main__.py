"""`python -m placement ...`: the `placement` command, for environments without the console script on PATH.

The command lives in `pipelines.cli` (it loads and runs pipelines), and `placement` must never import
`pipelines` (the layers point one way: pipelines -> hooks -> placement). So this module imports nothing of
it: it replaces this process with `python -m pipelines.cli ...`, the same interpreter, arguments and
environment, exactly what the console script runs. `import placement` is unaffected: Python runs this
module only for `python -m placement`.
"""

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
