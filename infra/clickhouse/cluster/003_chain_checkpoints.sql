-- Signed checkpoints, kept apart from the events (see single/003).
CREATE TABLE IF NOT EXISTS chain_checkpoints_local ON CLUSTER '${cluster}'
(
    chain_id   String,
    chain_seq  UInt64,
    chain_hash String,
    final      UInt8,
    writer     String,
    signed_at  DateTime64(6, 'UTC'),
    key_id     String,
    signature  String
)
ENGINE = ReplicatedMergeTree('/clickhouse/tables/{shard}/{database}/chain_checkpoints_local',
                             '{replica}')
ORDER BY (chain_id, chain_seq);

CREATE TABLE IF NOT EXISTS chain_checkpoints ON CLUSTER '${cluster}' AS chain_checkpoints_local
ENGINE = Distributed('${cluster}', currentDatabase(), chain_checkpoints_local,
                     cityHash64(chain_id));
