"""The test harness's gateway (tests/harness.py) starts only what a test asks for: the
notifier, like the audit and the MCP front door, only when the test hears from it; each
service's /healthz and /metrics only when the test reads them."""

from __future__ import annotations

from pathlib import Path

from tests.harness import Gateway, make_test_registry


def notifier_durables(gateway: Gateway) -> list[str]:
    return [durable for _, durable in gateway.durables() if durable.startswith("notifier")]


def test_a_test_gateway_runs_the_notifier_only_when_asked(tmp_path: Path) -> None:
    registry = make_test_registry(tmp_path / "registry")
    plain = Gateway(data_dir=tmp_path / "plain", registry_dir=registry)
    assert plain.stack.with_notifier is False
    # Ready (wait_ready) and settled (tests/waiting.py) without the notifier's durables.
    assert notifier_durables(plain) == []
    assert {"validator", "policy", "approvals"} <= {d for _, d in plain.durables()}

    notified = Gateway(data_dir=tmp_path / "notified", registry_dir=registry, with_notifier=True)
    assert notified.stack.with_notifier is True
    assert "notifier-deliveries" in notifier_durables(notified)


def test_a_test_gateway_serves_health_and_metrics_only_when_asked(tmp_path: Path) -> None:
    registry = make_test_registry(tmp_path / "registry")
    plain = Gateway(data_dir=tmp_path / "plain", registry_dir=registry)
    assert plain.stack.with_http is False
    assert plain.stack.http_args(4321) == []  # no `--http-port` for its services
    served = Gateway(data_dir=tmp_path / "served", registry_dir=registry, with_http=True)
    assert served.stack.http_args(4321)[:2] == ["--http-port", "4321"]
