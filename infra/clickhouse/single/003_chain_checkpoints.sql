-- Signed checkpoints of the sinks' hash chains, kept apart from the events:
-- grant the sink INSERT only, and auditors SELECT only, on this table.
-- chain_seq 0 is a chain's genesis (written before its first row), so a
-- chain with no signed checkpoint was not written by a sink holding the key.
CREATE TABLE IF NOT EXISTS chain_checkpoints
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
ENGINE = MergeTree
ORDER BY (chain_id, chain_seq)
SETTINGS non_replicated_deduplication_window = 10000;
