from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from toolgate.contracts.registry import BUILTIN_TOOLS_DIR, RegistryError, load_registry


def test_builtin_tools_load() -> None:
    registry = load_registry()
    assert {"search_sources", "fetch_document", "save_evidence"} <= set(registry.names())


def write_tool(directory: Path, **changes: object) -> Path:
    spec = yaml.safe_load((BUILTIN_TOOLS_DIR / "echo.yaml").read_text())
    spec.update(changes)
    directory.mkdir(exist_ok=True)
    path = directory / f"{spec.get('name', 'x')}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_bad_field_stops_loading_naming_file_and_field(tmp_path: Path) -> None:
    path = write_tool(tmp_path, timeout_s=-1)
    with pytest.raises(RegistryError) as raised:
        load_registry(tmp_path)
    assert str(path) in str(raised.value) and "timeout_s" in str(raised.value)


def test_unknown_field_is_refused(tmp_path: Path) -> None:
    write_tool(tmp_path, risky=True)
    with pytest.raises(RegistryError, match="risky"):
        load_registry(tmp_path)


def test_tool_name_must_be_subject_safe(tmp_path: Path) -> None:
    write_tool(tmp_path, name="evil.>")
    with pytest.raises(RegistryError, match="name"):
        load_registry(tmp_path)


def test_invalid_json_schema_is_refused(tmp_path: Path) -> None:
    write_tool(tmp_path, input_schema={"type": "no-such-type"})
    with pytest.raises(RegistryError, match="input_schema"):
        load_registry(tmp_path)


def test_a_tool_declared_twice_is_refused(tmp_path: Path) -> None:
    write_tool(tmp_path / "a")
    write_tool(tmp_path / "b")
    with pytest.raises(RegistryError, match="twice"):
        load_registry(tmp_path / "a", tmp_path / "b")


def test_registry_version_changes_with_content(tmp_path: Path) -> None:
    write_tool(tmp_path)
    before = load_registry(tmp_path).version
    write_tool(tmp_path, timeout_s=3)
    assert load_registry(tmp_path).version != before
