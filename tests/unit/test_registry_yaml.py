"""Every process a gateway starts reads the whole tool registry at start-up, some several
times, and `toolgate up` the NATS permissions too: with libyaml's loader where PyYAML has
it (about ten times faster than its pure-Python reader), the same documents."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from toolgate.contracts.registry import BUILTIN_TOOLS_DIR, load_registry, read_yaml
from toolgate.stack.nats_auth import PERMISSIONS_FILE, load_permissions

pytestmark = pytest.mark.skipif(not yaml.__with_libyaml__, reason="PyYAML without libyaml")


def test_the_registry_and_the_permissions_are_read_by_libyaml(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def pure_python_reader(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("read with PyYAML's pure-Python reader")

    expected = load_registry().names()
    monkeypatch.setattr(yaml.reader.Reader, "__init__", pure_python_reader)
    assert load_registry().names() == expected
    assert "roles" in load_permissions()


def test_libyaml_reads_the_same_documents() -> None:
    for path in [*sorted(BUILTIN_TOOLS_DIR.glob("*.yaml")), PERMISSIONS_FILE]:
        text = path.read_text()
        assert read_yaml(text) == yaml.safe_load(text), path
