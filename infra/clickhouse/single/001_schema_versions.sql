-- Which DDL files ran, with a checksum: a file edited after it ran is refused at start-up.
-- Several sinks may start at once and both record a version: readers take DISTINCT.
CREATE TABLE IF NOT EXISTS schema_versions
(
    version    UInt32,
    name       String,
    checksum   String,
    applied_at DateTime64(6, 'UTC') DEFAULT now64(6)
)
ENGINE = MergeTree
ORDER BY version;
