-- Every toolgate event as the audit sink wrote it: append-only, one row per write.
--
-- Plain MergeTree on purpose, not ReplacingMergeTree: each row is a link of a
-- sink's hash chain (chain_id, chain_seq, chain_hash), and a merge that
-- dropped a duplicate would cut a chain. A retried insert of the same block is
-- dropped by insert_deduplication_token (non_replicated_deduplication_window);
-- a copy written by another sink after a crash stays here and is removed in
-- reads: query the `events` view (one row per event_id), not this table.
--
-- The payload is the event as JSON *text* (String, not the JSON type): the
-- hash chain must read back exactly the bytes it hashed, and the JSON type
-- normalises. Query it with JSONExtract*(payload, ...) or payload::JSON.
CREATE TABLE IF NOT EXISTS event_log
(
    event_id         String,
    call_id          String,
    event_type       LowCardinality(String),
    occurred_at      DateTime64(6, 'UTC'),
    service          LowCardinality(String),
    tenant           LowCardinality(String),
    user             String,
    agent            LowCardinality(String),
    session          String,
    task_id          String,
    tool             LowCardinality(String),
    risk             LowCardinality(String),
    decision         LowCardinality(String),
    status           LowCardinality(String),
    error_code       LowCardinality(String),
    arguments_sha256 String,
    result_sha256    String,
    policy_version   LowCardinality(String),
    approver         String,
    duration_ms      Nullable(Float64),
    note             String,
    payload          String,
    source_stream    LowCardinality(String),
    source_seq       UInt64,
    chain_id         LowCardinality(String),
    chain_seq        UInt64,
    chain_hash       String,
    recorded_at      DateTime64(6, 'UTC') DEFAULT now64(6)
)
ENGINE = MergeTree
PARTITION BY toYYYYMM(occurred_at)
ORDER BY (call_id, occurred_at, event_id)
SETTINGS non_replicated_deduplication_window = 10000;
