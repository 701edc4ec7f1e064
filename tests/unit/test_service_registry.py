"""One registry of services (stack/services.py): `toolgate serve` offers exactly its
names and builds each one from it; `toolgate up` starts its pipeline hops; each stage
service's durables are its rows of the handler table."""

from __future__ import annotations

from pathlib import Path

import pytest
from faststream import FastStream

from toolgate.cli.main import build_parser
from toolgate.contracts.authorization import ensure_keypair
from toolgate.runtime.settings import GatewaySettings
from toolgate.runtime.topology import handlers
from toolgate.stack.services import PIPELINE, SERVICES


def serve_args(name: str, data_dir: Path) -> list[str]:
    extra = ["--clickhouse-url", "http://127.0.0.1:1"] if name == "audit" else []
    return ["serve", name, "--data-dir", str(data_dir), *extra]


def test_serve_offers_the_registrys_services(tmp_path: Path) -> None:
    parser = build_parser()
    for name in SERVICES:
        assert parser.parse_args(serve_args(name, tmp_path)).name == name
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "nosuch"])


@pytest.mark.parametrize("name", [name for name, s in SERVICES.items() if s.build is not None])
def test_each_service_is_built_from_serves_arguments(name: str, tmp_path: Path) -> None:
    args = build_parser().parse_args(serve_args(name, tmp_path))
    settings = GatewaySettings(nats_url="nats://127.0.0.1:1", data_dir=tmp_path)
    ensure_keypair(settings.keys_dir)  # as `toolgate up` made them
    build = SERVICES[name].build
    assert build is not None
    assert isinstance(build(settings, args), FastStream)  # nothing connects yet


def test_every_service_of_the_handler_table_is_registered() -> None:
    table = {h.service for h in handlers(["<tool>"], with_audit=True)}
    assert table <= set(SERVICES)
    assert set(PIPELINE) <= table
