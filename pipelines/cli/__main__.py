"""`python -m pipelines.cli ...`: the `placement` command without the console script."""

import sys

from . import main

sys.exit(main())
