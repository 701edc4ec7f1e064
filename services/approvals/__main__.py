"""`python -m toolgate.services.approvals list|show|approve|deny|add-approver|inbox|serve`."""

import sys

from toolgate.services.approvals.cli import main

sys.exit(main())
