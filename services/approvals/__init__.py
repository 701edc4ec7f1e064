"""The approvals service: humans approve or deny calls the policy holds back.

`logic` holds the rules (pure), `store` the per-call state in the JetStream
KV bucket `toolgate_approvals`, `app` the service (consumes
`ApprovalRequested`, answers votes on `toolgate.approvals.vote`, expires
stale requests), `client` what the CLI and the web `inbox` vote through.
"""
