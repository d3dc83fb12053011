"""`python -m telemetry.cli`: the `ascend-guard` command line, for hosts without the console script."""

import sys

from telemetry.cli.main import main

sys.exit(main())
