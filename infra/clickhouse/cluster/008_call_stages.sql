-- The table and view of single/008 (read that file's comment), per shard: a call's events
-- all live on one shard (event_log is sharded by call_id), so each shard's call_stages_local
-- holds whole calls, filled by the view on that shard's event_log_local; `call_stages`
-- (Distributed, sharded the same way) is what queries read.
CREATE TABLE IF NOT EXISTS call_stages_local ON CLUSTER '${cluster}'
(
    tenant                LowCardinality(String),
    agent                 LowCardinality(String),
    call_id               String,
    tool                  SimpleAggregateFunction(max, String),
    last_decision         AggregateFunction(argMax, String, DateTime64(6, 'UTC')),
    executed              SimpleAggregateFunction(max, UInt8),
    requested_at          SimpleAggregateFunction(min, Nullable(DateTime64(6, 'UTC'))),
    checked_at            SimpleAggregateFunction(min, Nullable(DateTime64(6, 'UTC'))),
    decided_at            SimpleAggregateFunction(min, Nullable(DateTime64(6, 'UTC'))),
    approval_requested_at SimpleAggregateFunction(min, Nullable(DateTime64(6, 'UTC'))),
    approval_decided_at   SimpleAggregateFunction(max, Nullable(DateTime64(6, 'UTC'))),
    authorized_at         SimpleAggregateFunction(max, Nullable(DateTime64(6, 'UTC'))),
    started_at            SimpleAggregateFunction(min, Nullable(DateTime64(6, 'UTC'))),
    finished_at           SimpleAggregateFunction(max, Nullable(DateTime64(6, 'UTC'))),
    attached_at           SimpleAggregateFunction(min, Nullable(DateTime64(6, 'UTC'))),
    execute_ms            SimpleAggregateFunction(max, Nullable(Float64))
)
ENGINE = ReplicatedAggregatingMergeTree('/clickhouse/tables/{shard}/{database}/call_stages_local',
                                        '{replica}')
ORDER BY (tenant, agent, call_id);

CREATE TABLE IF NOT EXISTS call_stages ON CLUSTER '${cluster}' AS call_stages_local
ENGINE = Distributed('${cluster}', currentDatabase(), call_stages_local, cityHash64(call_id));

-- On each shard: the blocks inserted into its event_log_local (an insert into the
-- Distributed event_log arrives there), into its call_stages_local.
-- It runs as the admin that created it (SQL SECURITY DEFINER): the sink's login may only
-- INSERT into event_log, and must not be given SELECT on it or INSERT on call_stages.
CREATE MATERIALIZED VIEW IF NOT EXISTS call_stages_mv ON CLUSTER '${cluster}' TO call_stages_local
DEFINER = CURRENT_USER SQL SECURITY DEFINER AS
SELECT
    tenant,
    agent,
    call_id,
    maxIf(toString(tool), tool != '')                                              AS tool,
    argMaxStateIf(toString(decision), occurred_at, decision != '')                 AS last_decision,
    max(event_type = 'ExecutionStarted')                                           AS executed,
    minIfOrNull(occurred_at, event_type = 'CallRequested')                         AS requested_at,
    minIfOrNull(occurred_at, event_type IN ('ArgumentsValidated', 'ArgumentsRejected'))
                                                                                   AS checked_at,
    minIfOrNull(occurred_at, event_type IN ('CallAuthorized', 'CallDenied', 'ApprovalRequested'))
                                                                                   AS decided_at,
    minIfOrNull(occurred_at, event_type = 'ApprovalRequested')                     AS approval_requested_at,
    maxIfOrNull(occurred_at, event_type IN ('ApprovalGranted', 'ApprovalDenied', 'ApprovalExpired'))
                                                                                   AS approval_decided_at,
    maxIfOrNull(occurred_at, event_type = 'CallAuthorized')                        AS authorized_at,
    minIfOrNull(occurred_at, event_type = 'ExecutionStarted')                      AS started_at,
    maxIfOrNull(occurred_at, event_type IN ('ExecutionSucceeded', 'ExecutionFailed'))
                                                                                   AS finished_at,
    minIfOrNull(occurred_at, event_type = 'ResultAttached')                        AS attached_at,
    maxIfOrNull(duration_ms, event_type IN ('ExecutionSucceeded', 'ExecutionFailed'))
                                                                                   AS execute_ms
FROM event_log_local
WHERE call_id != ''
GROUP BY tenant, agent, call_id;

-- A store made before 008: the calls already there, once (the view above sees only new
-- blocks; a block it saw and this also read is counted twice, which min/max ignore).
-- Runs at the sink's start-up, in one pass over event_log's short columns; from one node,
-- through the Distributed tables (each call's row lands on its own shard).
INSERT INTO call_stages
SELECT
    tenant,
    agent,
    call_id,
    maxIf(toString(tool), tool != ''),
    argMaxStateIf(toString(decision), occurred_at, decision != ''),
    max(event_type = 'ExecutionStarted'),
    minIfOrNull(occurred_at, event_type = 'CallRequested'),
    minIfOrNull(occurred_at, event_type IN ('ArgumentsValidated', 'ArgumentsRejected')),
    minIfOrNull(occurred_at, event_type IN ('CallAuthorized', 'CallDenied', 'ApprovalRequested')),
    minIfOrNull(occurred_at, event_type = 'ApprovalRequested'),
    maxIfOrNull(occurred_at, event_type IN ('ApprovalGranted', 'ApprovalDenied', 'ApprovalExpired')),
    maxIfOrNull(occurred_at, event_type = 'CallAuthorized'),
    minIfOrNull(occurred_at, event_type = 'ExecutionStarted'),
    maxIfOrNull(occurred_at, event_type IN ('ExecutionSucceeded', 'ExecutionFailed')),
    minIfOrNull(occurred_at, event_type = 'ResultAttached'),
    maxIfOrNull(duration_ms, event_type IN ('ExecutionSucceeded', 'ExecutionFailed'))
FROM event_log
WHERE call_id != ''
GROUP BY tenant, agent, call_id;
