"""The `toolgate` command line: thin commands over the services, client and stack.

main.py builds the parser from each command group's `register(commands)`, runs the
command and maps its failure to an exit code; common.py holds what every command shares
(a failure in one line, the checks of its input, a NATS connection within a timeout).
One module per command group, its parsers beside its handlers: up, serve, agents, calls
(`call`, `result`), schema, audit, status, approvals, policy, mcp (`tools ...`), bench.
reference.py writes docs/reference/cli.md from the parser.
"""
