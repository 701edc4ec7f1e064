-- The view of single/005 (read that file's comment), on every node.
-- A call is (tenant, agent, call_id), not call_id alone: the same call_id from
-- two agents is two independent calls (wire contract v2). 004's `calls` grouped
-- by call_id only, so two agents' calls with one call_id merged into one row
-- (one agent's approval could even hide another's unapproved execution).
-- This replaces it; the columns stay, tenant, agent and call_id lead, and
-- `call_key` is the identity as one string, `TENANT.AGENT.CALL_ID` (the key the
-- approvals and outcome buckets use). A row whose sender is unknown (a raw call
-- stored outside any agent's subject) has empty tenant and agent, so it stays
-- apart instead of merging into a real call.
--
-- `calls`: one row per call, its final status and the time spent in each stage
-- (NULL where the call never reached the stage). Stage boundaries:
--   check    requested          -> arguments validated / rejected   (validator)
--   policy   arguments checked  -> authorized / denied / approval requested
--   approval approval requested -> last approval decision            (a human)
--   queue    authorized         -> execution started                  (executor backlog)
--   execute  the tool's own duration_ms
--   attach   execution finished -> result attached                   (output check)
--   total    requested          -> result attached
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
    countIf(event_type = 'ResultAttached')                         AS results,
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
    count()                                                        AS events
FROM events
WHERE call_id != ''
GROUP BY tenant, agent, call_id;
