-- The auditor's queries answer from what their WHERE reaches (issue #26: at 10 million
-- events four QUERIES.md queries took 2-4.4 s, every one of them over `calls`).
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
-- (a mutation, in the background: start-up does not wait) builds it for the old ones.
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

ALTER TABLE event_log_local ON CLUSTER '${cluster}' MATERIALIZE PROJECTION per_call;
