"""A service that died is restarted on a port of its own again (stack/supervisor.py).

Seen with gateways started side by side: another process's listener drew a
service's /metrics port while it restarted, and the service then died of
"address already in use" at every restart, for as long as the gateway ran.
"""

from __future__ import annotations

from pathlib import Path

from toolgate.stack.supervisor import ServiceProcess


def test_a_moved_port_is_what_the_next_start_binds_and_what_status_reads() -> None:
    service = ServiceProcess(
        "policy",
        ["toolgate", "serve", "policy", "--http-port", "17263", "--health-grace", "5"],
        Path("policy.log"),
        http_port=17263,
    )
    service.move_http_port(20001)
    assert service.command == [
        "toolgate", "serve", "policy", "--http-port", "20001", "--health-grace", "5"
    ]  # fmt: skip
    assert service.http_url == "http://127.0.0.1:20001"


def test_a_service_without_health_endpoints_keeps_its_command() -> None:
    service = ServiceProcess("policy", ["toolgate", "serve", "policy"], Path("policy.log"))
    service.move_http_port(20001)
    assert service.command == ["toolgate", "serve", "policy"]
    assert service.http_url is None
