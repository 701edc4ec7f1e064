-- The events, sharded by call_id (a call's events, and any duplicate of one
-- of them, live on one shard) and replicated within each shard.
-- ReplicatedMergeTree dedupes retried blocks by insert_deduplication_token
-- out of the box (replicated_deduplication_window). Same columns and the same
-- reasoning as single/002_event_log.sql.
CREATE TABLE IF NOT EXISTS event_log_local ON CLUSTER '${cluster}'
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
ENGINE = ReplicatedMergeTree('/clickhouse/tables/{shard}/{database}/event_log_local', '{replica}')
PARTITION BY toYYYYMM(occurred_at)
ORDER BY (call_id, occurred_at, event_id);

-- What the sink inserts into and auditors read from. The sink's ClickHouse
-- user must insert synchronously (profile: distributed_foreground_insert = 1,
-- insert_quorum = 'auto'), so an insert's answer means "stored on the shards".
CREATE TABLE IF NOT EXISTS event_log ON CLUSTER '${cluster}' AS event_log_local
ENGINE = Distributed('${cluster}', currentDatabase(), event_log_local, cityHash64(call_id));
