from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from toolgate.contracts.registry import BUILTIN_TOOLS_DIR, RegistryError, load_registry, tool_dirs
from toolgate.runtime.settings import GatewaySettings


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


def test_a_tool_declared_twice_is_refused_naming_both_files(tmp_path: Path) -> None:
    first = write_tool(tmp_path / "a")
    second = write_tool(tmp_path / "b")
    with pytest.raises(RegistryError, match="twice") as raised:
        load_registry(tmp_path / "a", tmp_path / "b")
    assert str(first) in str(raised.value) and str(second) in str(raised.value)


class TestRegistryDirs:
    """`--registry DIR` (GatewaySettings.registry_dirs) adds to the built-in tools."""

    def test_a_registry_dir_adds_its_tools_beside_the_builtin_ones(self, tmp_path: Path) -> None:
        write_tool(tmp_path, name="pay_out")
        names = GatewaySettings(registry_dirs=(tmp_path,)).load_registry().names()
        assert set(names) == {"pay_out", *load_registry(BUILTIN_TOOLS_DIR).names()}

    def test_without_the_builtin_tools_only_the_dirs_tools(self, tmp_path: Path) -> None:
        write_tool(tmp_path, name="pay_out")
        settings = GatewaySettings(registry_dirs=(tmp_path,), builtin_tools=False)
        assert settings.load_registry().names() == ["pay_out"]

    def test_a_dir_redefining_a_builtin_tool_is_refused_naming_both(self, tmp_path: Path) -> None:
        mine = write_tool(tmp_path, name="echo")
        with pytest.raises(RegistryError) as raised:
            GatewaySettings(registry_dirs=(tmp_path,)).load_registry()
        message = str(raised.value)
        assert str(mine) in message and str(BUILTIN_TOOLS_DIR / "echo.yaml") in message
        assert "--no-builtin-tools" in message
        # ...and taken instead of the built-in tools when asked
        settings = GatewaySettings(registry_dirs=(tmp_path,), builtin_tools=False)
        assert settings.load_registry().names() == ["echo"]

    def test_no_builtin_tools_and_no_dir_is_no_tools(self) -> None:
        with pytest.raises(RegistryError, match="no tools"):
            GatewaySettings(builtin_tools=False).load_registry()

    def test_the_builtin_dir_named_again_counts_once(self, tmp_path: Path) -> None:
        # A context.json written before the change named the built-in dir among its dirs.
        assert tool_dirs([BUILTIN_TOOLS_DIR, tmp_path]) == [BUILTIN_TOOLS_DIR, tmp_path]


def test_registry_version_changes_with_content(tmp_path: Path) -> None:
    write_tool(tmp_path)
    before = load_registry(tmp_path).version
    write_tool(tmp_path, timeout_s=3)
    assert load_registry(tmp_path).version != before
