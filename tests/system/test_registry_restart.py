"""A registry pushed yesterday is served after a restart, whatever --registry says: and
`toolgate up` says so.

The finding: an operator edits a tool file of the `--registry` folder (say, to make a
tool ask for approval), restarts `toolgate up --registry DIR`, and the version pushed
earlier goes on being served, silently: `toolgate up` named the policy bundle in use but
not the registry, and nothing said the edit does nothing until pushed.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.harness import Gateway, make_test_registry
from tests.system.test_registry_push import toolgate

pytestmark = pytest.mark.system


def test_up_names_the_pushed_registry_and_a_local_one_that_differs(tmp_path: Path) -> None:
    data_dir = tmp_path / ".toolgate"
    registry = make_test_registry(tmp_path / "registry")
    first = Gateway(data_dir=data_dir, registry_dir=registry).start()
    try:
        assert first.stack.registry_line == ""  # nothing pushed: the local registry
        pushed = toolgate(data_dir, "tools", "push", str(registry))
        assert pushed.returncode == 0, pushed.stderr
    finally:
        first.stop()
    echo = registry / "echo.yaml"
    spec = yaml.safe_load(echo.read_text())
    echo.write_text(yaml.safe_dump({**spec, "requires_approval": True}))  # the edit
    again = Gateway(data_dir=data_dir, registry_dir=registry).start()
    try:
        assert again.stack.registry_line.startswith(f"version 1 (pushed from {registry}")
        differs = again.stack.registry_differs or ""
        assert "not the local registry" in differs and "toolgate tools push" in differs
    finally:
        again.stop()
