"""`python -m toolgate.cli`: the same as the `toolgate` command."""

import sys

from toolgate.cli.main import main

sys.exit(main())
