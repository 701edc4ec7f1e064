-- toolgate's ClickHouse users: an insert-only writer (the audit sink), a read-only
-- auditor (toolgate audit ..., policy test), an admin for the DDL. None may use a
-- table function that reads or writes outside (no READ/WRITE ON FILE, URL, S3, ...),
-- kill another user's query or run SYSTEM. Run as a user with access management,
-- with the three ${..._password} placeholders replaced; give each service its URL:
--   http://toolgate_writer:PASSWORD@HOST:8123/toolgate  (toolgate serve audit)
-- ClickHouse's own `default` user needs none of this: give it a password or drop it
-- (toolgate never logs in as `default`).
-- Rendered by toolgate.stack.clickhouse_access.access_ddl (a test keeps it in step).
CREATE USER IF NOT EXISTS toolgate_admin IDENTIFIED WITH sha256_password BY '${admin_password}';
CREATE USER IF NOT EXISTS toolgate_writer IDENTIFIED WITH sha256_password BY '${writer_password}';
CREATE USER IF NOT EXISTS toolgate_auditor IDENTIFIED WITH sha256_password BY '${auditor_password}';
GRANT SELECT, INSERT, ALTER, CREATE DATABASE, CREATE TABLE, CREATE VIEW, DROP TABLE, DROP VIEW, DROP DATABASE, TRUNCATE, OPTIMIZE, SHOW ON *.* TO toolgate_admin;
GRANT TABLE ENGINE ON MergeTree TO toolgate_admin;
GRANT TABLE ENGINE ON ReplicatedMergeTree TO toolgate_admin;
GRANT TABLE ENGINE ON AggregatingMergeTree TO toolgate_admin;
GRANT TABLE ENGINE ON ReplicatedAggregatingMergeTree TO toolgate_admin;
GRANT TABLE ENGINE ON Distributed TO toolgate_admin;
GRANT INSERT ON `toolgate`.event_log TO toolgate_writer;
GRANT INSERT ON `toolgate`.chain_checkpoints TO toolgate_writer;
GRANT SELECT ON `toolgate`.schema_versions TO toolgate_writer;
GRANT SELECT, SHOW TABLES ON `toolgate`.* TO toolgate_auditor;
