-- The orders database of the example (SQLite). `toolgate up --example orders`
-- creates <data-dir>/examples/orders/orders.sqlite3 from this file when it is
-- missing, and re-applies it (adding only missing rows) when it is there.
-- Amounts are whole units of `currency` (integers: the policy compares them).

PRAGMA journal_mode = WAL;

CREATE TABLE IF NOT EXISTS orders (
    id        TEXT PRIMARY KEY,
    tenant    TEXT NOT NULL,
    owner     TEXT NOT NULL,          -- the user id of the wire contract's principal
    status    TEXT NOT NULL,          -- placed | shipped | delivered | cancelled
    amount    INTEGER NOT NULL,
    refunded  INTEGER NOT NULL DEFAULT 0,
    currency  TEXT NOT NULL,
    placed_at TEXT NOT NULL
);

CREATE TABLE IF NOT EXISTS refunds (
    refund_key  TEXT PRIMARY KEY,     -- tenant.agent.call_id: a retried call refunds once
    order_id    TEXT NOT NULL REFERENCES orders (id),
    tenant      TEXT NOT NULL,
    amount      INTEGER NOT NULL,
    reason      TEXT NOT NULL DEFAULT '',
    refunded_by TEXT NOT NULL,        -- the user the agent acted for
    refunded_at TEXT NOT NULL
);

INSERT OR IGNORE INTO orders (id, tenant, owner, status, amount, refunded, currency, placed_at)
VALUES
    ('o-1001', 'acme', 'u-alice', 'delivered', 1200, 0, 'EUR', '2026-11-02T10:15:00Z'),
    ('o-2002', 'acme', 'u-bob',   'delivered',  300, 0, 'EUR', '2026-11-20T16:40:00Z');
