-- The view of single/006 over the Distributed tables (each event's copies live on one
-- shard: sharded by call_id), the index on each shard's local table.
-- `events`, deduplicated so that a filter reaches the table's primary key.
--
-- 004's view ended in `LIMIT 1 BY event_id`, and ClickHouse pushes no WHERE
-- below a LIMIT BY: `toolgate audit trace` (WHERE tenant, agent, call_id) read
-- the whole table, 2.4 s at 8.6 million rows. Copies of an event are identical
-- in content, so grouping by columns that every copy shares keeps one row per
-- event just the same, and a filter on any of those keys is pushed down to the
-- primary key (call_id leads it). The grouping streams in the order of the
-- sort key (call_id first): memory stays small however large the table is.
-- The columns are 004's, in 004's order.
CREATE OR REPLACE VIEW events ON CLUSTER '${cluster}' AS
SELECT
    event_id, call_id, event_type, occurred_at, service, tenant,
    any(user) AS user, agent, any(session) AS session, any(task_id) AS task_id, tool,
    any(risk) AS risk, any(decision) AS decision, any(status) AS status,
    any(error_code) AS error_code, any(arguments_sha256) AS arguments_sha256,
    any(result_sha256) AS result_sha256, any(policy_version) AS policy_version,
    any(approver) AS approver, any(duration_ms) AS duration_ms, note,
    any(payload) AS payload, any(source_stream) AS source_stream,
    any(source_seq) AS source_seq, min(recorded_at) AS recorded_at
FROM event_log
GROUP BY call_id, event_id, event_type, occurred_at, service, tenant, agent, tool, note
SETTINGS optimize_aggregation_in_order = 1;

-- `calls` (005's, same columns) straight from event_log: every aggregate of it is
-- unchanged by a second copy of an event (any, argMax, min, max, groupUniqArray,
-- "count > 0"), and the two counts count distinct event_ids, so it needs no
-- deduplicated input. Measured at 1.5 million events (bench audit-queries): the
-- calls queries of QUERIES.md 0.12-0.20 s instead of 0.35-0.55 s, a trace 12 ms
-- instead of 240 ms, the events queries 0.01-0.09 s instead of 0.15-0.22 s.
CREATE OR REPLACE VIEW calls ON CLUSTER '${cluster}' AS
SELECT
    tenant,
    agent,
    call_id,
    concat(tenant, '.', agent, '.', call_id)                       AS call_key,
    anyIf(tool, tool != '')                                        AS tool,
    anyIf(risk, risk != '')                                        AS risk,
    anyIf(user, user != '')                                        AS user,
    anyIf(session, session != '')                                  AS session,
    anyIf(task_id, task_id != '')                                  AS task_id,
    argMaxIf(status, occurred_at, event_type = 'ResultAttached')   AS final_status,
    argMaxIf(error_code, occurred_at, event_type = 'ResultAttached') AS final_error_code,
    argMaxIf(decision, occurred_at, decision != '')                AS last_decision,
    argMaxIf(policy_version, occurred_at, policy_version != '')    AS policy_version,
    groupUniqArrayIf(approver, event_type = 'ApprovalGranted')     AS approvers,
    -- Approved: the vote that completed the quorum was recorded.
    countIf(event_type = 'ApprovalGranted'
            AND JSONExtractBool(payload, 'quorum_reached')) > 0    AS approved,
    countIf(event_type = 'ExecutionStarted') > 0                   AS executed,
    uniqExactIf(event_id, event_type = 'ResultAttached')          AS results,
    minIfOrNull(occurred_at, event_type = 'CallRequested')         AS requested_at,
    minIfOrNull(occurred_at, event_type IN ('ArgumentsValidated', 'ArgumentsRejected'))
                                                                   AS checked_at,
    minIfOrNull(occurred_at, event_type IN ('CallAuthorized', 'CallDenied', 'ApprovalRequested'))
                                                                   AS decided_at,
    minIfOrNull(occurred_at, event_type = 'ApprovalRequested')     AS approval_requested_at,
    maxIfOrNull(occurred_at, event_type IN ('ApprovalGranted', 'ApprovalDenied', 'ApprovalExpired'))
                                                                   AS approval_decided_at,
    maxIfOrNull(occurred_at, event_type = 'CallAuthorized')        AS authorized_at,
    minIfOrNull(occurred_at, event_type = 'ExecutionStarted')      AS started_at,
    maxIfOrNull(occurred_at, event_type IN ('ExecutionSucceeded', 'ExecutionFailed'))
                                                                   AS finished_at,
    minIfOrNull(occurred_at, event_type = 'ResultAttached')        AS attached_at,
    maxIfOrNull(duration_ms, event_type IN ('ExecutionSucceeded', 'ExecutionFailed'))
                                                                   AS execute_ms,
    dateDiff('microsecond', requested_at, checked_at) / 1000.0           AS check_ms,
    dateDiff('microsecond', checked_at, decided_at) / 1000.0             AS policy_ms,
    dateDiff('microsecond', approval_requested_at, approval_decided_at) / 1000.0 AS approval_ms,
    dateDiff('microsecond', authorized_at, started_at) / 1000.0          AS queue_ms,
    dateDiff('microsecond', finished_at, attached_at) / 1000.0           AS attach_ms,
    dateDiff('microsecond', requested_at, attached_at) / 1000.0          AS total_ms,
    uniqExact(event_id)                                            AS events
FROM event_log
WHERE call_id != ''
GROUP BY tenant, agent, call_id;

-- Lookups by time (the calls of the last hour, a night's denials) skip the parts
-- and granules whose events are all older or newer; months are partitions already.
ALTER TABLE event_log_local ON CLUSTER '${cluster}' ADD INDEX IF NOT EXISTS occurred_at_range occurred_at TYPE minmax GRANULARITY 4;
