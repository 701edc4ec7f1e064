"""The seed's order example: a support agent, acting for a user, and that user's orders.

`toolgate up --example orders` runs the gateway with this example beside the
built-in tools: the tools in `registry/` (query_order, refund_order; their
functions in tools.py), the orders database made from `seed.sql` under the
data dir, and the policy bundle in `policy/` (the default bundle plus
orders.cedar, the Order entity and its SQL provider). docs/policy-examples.md:
"Worked example 3: orders".
"""

from __future__ import annotations

import sqlite3
from contextlib import closing
from pathlib import Path

EXAMPLE_DIR = Path(__file__).resolve().parent
REGISTRY_DIR = EXAMPLE_DIR / "registry"
POLICY_DIR = EXAMPLE_DIR / "policy"
SEED_FILE = EXAMPLE_DIR / "seed.sql"
# Under the gateway's data dir; the tools (settings.database) and the bundle's SQL
# provider (entities.Order.database) name the same relative path.
DATABASE = Path("examples") / "orders" / "orders.sqlite3"
# The identities `toolgate up --example orders` mints: the seed's customer-service agent.
AGENTS = (("acme", "support"),)
TRY = 'toolgate call query_order \'{"order_id": "o-1001"}\' --user u-alice'


def database_path(data_dir: Path) -> Path:
    return data_dir / DATABASE


def prepare(data_dir: Path) -> Path:
    """Create (or complete) the orders database from the seed; its path."""
    path = database_path(data_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    with closing(sqlite3.connect(path)) as connection:
        connection.executescript(SEED_FILE.read_text(encoding="utf-8"))
        connection.commit()
    return path
