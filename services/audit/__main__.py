"""`python -m toolgate.services.audit`: the audit sink, as `toolgate serve audit` runs it."""

import sys

from toolgate.services.audit.cli import main

if __name__ == "__main__":
    sys.exit(main())
