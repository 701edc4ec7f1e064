-- Two auditor queries need every call (issue #26: at 10 million events, 2.09 million
-- calls, "p50 / p99 time per stage, per tool" took 13-26 s and "calls still without a
-- result" 5.7-27 s, both merging every call's aggregate states from 007's `per_call`
-- projection at query time). `call_stages` keeps what those two read, one row per call
-- once ClickHouse has merged its parts: the times at each stage boundary, the tool,
-- whether it executed, its last decision. A materialized view adds each inserted
-- block's share; background merges combine a call's rows into one (AggregatingMergeTree,
-- sorted by the call's identity), so a query reads one finished row per call (FINAL
-- merges only what the background has not yet) instead of aggregating every call.
--
-- It keeps open calls too: `calls` reports the stages an open call reached (the p50 query
-- counts them), and "still without a result" is exactly the rows with no attached_at.
--
-- Every aggregate is min, max or argMax: a second copy of an event (a redelivery written
-- by another sink, or the backfill below meeting a block the view also saw) changes
-- nothing, as in `calls`. The columns are `calls`' own expressions (005/006): per stage
-- boundary the same event types and the same min or max. `tool` is max() of the
-- non-empty tool (`calls` takes any(): the same value, every event of a call names its
-- tool). A call is (tenant, agent, call_id), never call_id alone.
CREATE TABLE IF NOT EXISTS call_stages
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
ENGINE = AggregatingMergeTree
ORDER BY (tenant, agent, call_id);

-- Each block the sink inserts into event_log, grouped by call: a few rows per block.
-- It runs as the admin that created it (SQL SECURITY DEFINER): the sink's login may only
-- INSERT into event_log, and must not be given SELECT on it or INSERT on call_stages.
CREATE MATERIALIZED VIEW IF NOT EXISTS call_stages_mv TO call_stages
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
FROM event_log
WHERE call_id != ''
GROUP BY tenant, agent, call_id;

-- A store made before 008: the calls already there, once (the view above sees only new
-- blocks; a block it saw and this also read is counted twice, which min/max ignore).
-- Runs at the sink's start-up, in one pass over event_log's short columns.
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
