-- The auditor's queries answer from what their WHERE reaches (issue #26: at 10 million
-- events four QUERIES.md queries took 2-4.4 s).
--
-- `calls` groups event_log by (tenant, agent, call_id): each of its queries aggregated
-- every event of every call, and "high-risk calls without approval" also parsed every
-- event's payload (JSONExtractBool for `approved`). `per_call` is that aggregation
-- stored with each part, as ClickHouse writes the part: one row per call and part, the
-- JSON read once at insert time. A query over `calls` (006's view, unchanged: the
-- projection's aggregates are the view's, expression for expression, which is how
-- ClickHouse matches them) then merges those rows instead of reading the events; a part
-- without the projection (not yet materialized) is read as before, so answers never
-- change, only their cost. Merges keep the projection; the sink's inserts are unchanged.
--
-- The String columns' test is written `notEmpty(x)`: ClickHouse rewrites the view's
-- `x != ''` on a String (not on a LowCardinality) to that before it matches a projection.
--
-- An existing store gets it at the next start: ADD adds it to new parts, MATERIALIZE
-- (a mutation, in the background: start-up does not wait for it, whatever the server's
-- mutations_sync; chdb-core's is 1) builds it for the old ones.
-- Cluster: on each shard's local table (a call's events all live on one shard).
ALTER TABLE event_log_local ON CLUSTER '${cluster}' ADD PROJECTION IF NOT EXISTS per_call
(
    SELECT
        tenant, agent, call_id,
        anyIf(tool, tool != ''),
        anyIf(risk, risk != ''),
        anyIf(user, notEmpty(user)),
        anyIf(session, notEmpty(session)),
        anyIf(task_id, notEmpty(task_id)),
        argMaxIf(status, occurred_at, event_type = 'ResultAttached'),
        argMaxIf(error_code, occurred_at, event_type = 'ResultAttached'),
        argMaxIf(decision, occurred_at, decision != ''),
        argMaxIf(policy_version, occurred_at, policy_version != ''),
        groupUniqArrayIf(approver, event_type = 'ApprovalGranted'),
        countIf(event_type = 'ApprovalGranted' AND JSONExtractBool(payload, 'quorum_reached')),
        countIf(event_type = 'ExecutionStarted'),
        uniqExactIf(event_id, event_type = 'ResultAttached'),
        minIfOrNull(occurred_at, event_type = 'CallRequested'),
        minIfOrNull(occurred_at, event_type IN ('ArgumentsValidated', 'ArgumentsRejected')),
        minIfOrNull(occurred_at, event_type IN ('CallAuthorized', 'CallDenied', 'ApprovalRequested')),
        minIfOrNull(occurred_at, event_type = 'ApprovalRequested'),
        maxIfOrNull(occurred_at, event_type IN ('ApprovalGranted', 'ApprovalDenied', 'ApprovalExpired')),
        maxIfOrNull(occurred_at, event_type = 'CallAuthorized'),
        minIfOrNull(occurred_at, event_type = 'ExecutionStarted'),
        maxIfOrNull(occurred_at, event_type IN ('ExecutionSucceeded', 'ExecutionFailed')),
        minIfOrNull(occurred_at, event_type = 'ResultAttached'),
        maxIfOrNull(duration_ms, event_type IN ('ExecutionSucceeded', 'ExecutionFailed')),
        uniqExact(event_id)
    GROUP BY tenant, agent, call_id
);

ALTER TABLE event_log_local ON CLUSTER '${cluster}' MATERIALIZE PROJECTION per_call
    SETTINGS mutations_sync = 0, alter_sync = 0;

-- The queries over `events` filter on event_type (denials, approvals, dead letters, calls
-- given up on): a few percent of the rows, spread over every granule of a table sorted by
-- call_id, so each read every granule, and the denials' example message read every
-- payload (6.5 GB at 10 million events). `by_event_type` keeps the events again sorted
-- by event_type, so such a filter reads only the matching events. It holds every column
-- `events` serves but the two SHA-256 columns (incompressible: a query on them reads the
-- table, as before), and not the chain columns (verify reads the table). The cost: the
-- payload is stored twice, and each insert writes it twice.
ALTER TABLE event_log_local ON CLUSTER '${cluster}' ADD PROJECTION IF NOT EXISTS by_event_type
(
    SELECT
        event_id, call_id, event_type, occurred_at, service, tenant, user, agent, session,
        task_id, tool, risk, decision, status, error_code, policy_version, approver,
        duration_ms, note, payload, source_stream, source_seq, recorded_at
    ORDER BY event_type, occurred_at
);

ALTER TABLE event_log_local ON CLUSTER '${cluster}' MATERIALIZE PROJECTION by_event_type
    SETTINGS mutations_sync = 0, alter_sync = 0;

-- `events` (006's, the same columns in the same order) grouped by risk and status too:
-- every copy of an event carries the same ones, so it is still one row per event, and a
-- WHERE on them now reaches the table instead of filtering after the grouping. The calls
-- queries of QUERIES.md that pick a few calls (high risk, invalid results) name them
-- first with such a filter, then read only those calls from `calls`.
CREATE OR REPLACE VIEW events ON CLUSTER '${cluster}' AS
SELECT
    event_id, call_id, event_type, occurred_at, service, tenant,
    any(user) AS user, agent, any(session) AS session, any(task_id) AS task_id, tool,
    risk, any(decision) AS decision, status,
    any(error_code) AS error_code, any(arguments_sha256) AS arguments_sha256,
    any(result_sha256) AS result_sha256, any(policy_version) AS policy_version,
    any(approver) AS approver, any(duration_ms) AS duration_ms, note,
    any(payload) AS payload, any(source_stream) AS source_stream,
    any(source_seq) AS source_seq, min(recorded_at) AS recorded_at
FROM event_log
GROUP BY call_id, event_id, event_type, occurred_at, service, tenant, agent, tool, note, risk,
    status
SETTINGS optimize_aggregation_in_order = 1;
