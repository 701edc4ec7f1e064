-- Which DDL files ran. One replicated table for the whole cluster (no {shard}
-- in the path): every node answers the same versions.
CREATE TABLE IF NOT EXISTS schema_versions ON CLUSTER '${cluster}'
(
    version    UInt32,
    name       String,
    checksum   String,
    applied_at DateTime64(6, 'UTC') DEFAULT now64(6)
)
ENGINE = ReplicatedMergeTree('/clickhouse/tables/{database}/schema_versions', '{replica}')
ORDER BY version;
