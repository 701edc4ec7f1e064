"""bench/targets.py: the one place a bench picks its gateway (a running one here; the
private one is started by the bench commands' system tests)."""

from __future__ import annotations

import argparse
from pathlib import Path

from toolgate.bench.targets import PRINCIPAL, gateway_target


def test_a_running_gateway_is_used_as_given_and_nothing_is_started(tmp_path: Path) -> None:
    args = argparse.Namespace(nats_url="nats://127.0.0.1:1", creds=None, agent_creds=None)
    with gateway_target(args, tmp_path, running="a running gateway at X") as target:
        assert target.nats_url == "nats://127.0.0.1:1"
        assert target.description == "a running gateway at X"
        assert target.principal == PRINCIPAL  # no agent creds: bench.bench
    assert not (tmp_path / "gateway").exists()
