"""The tool registry: each tool declared as data, one YAML file per tool.

Files are validated with pydantic at start-up; a bad file stops start-up
with a message naming the file and the field. The Python function behind a
tool is named by the operator in the file (`function: package.module:attr`)
and resolved only by the executor: never from a string the model sent.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from .subjects import TOOL_NAME_PATTERN

BUILTIN_TOOLS_DIR = Path(__file__).parent / "tools"

Risk = Literal["low", "medium", "high", "critical"]
AuditMode = Literal["full", "hash", "none"]


class RegistryError(Exception):
    """A registry file is missing, unreadable or invalid."""


class RateLimit(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    calls: int = Field(gt=0)
    per_seconds: float = Field(gt=0)


class AuditSpec(BaseModel):
    """What the audit store keeps of this tool's arguments and results."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    arguments: AuditMode = "full"
    result: AuditMode = "full"


class ToolSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    description: str = Field(min_length=1)
    input_schema: dict[str, Any]
    output_schema: dict[str, Any]
    function: str = Field(pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
    read_only: bool
    timeout_s: float = Field(gt=0, le=3600)
    risk: Risk
    requires_approval: bool = False
    # Whether running the function again for the same call_id is harmless
    # (it dedupes on call_id itself, or has no side effect). The executor
    # re-runs an interrupted call only when this is true.
    idempotent: bool = False
    retryable_errors: bool = True
    # The argument that names the task the call writes into; when set, the
    # policy requires it to equal the call's own task_id (no cross-task writes).
    task_scope: str | None = None
    allowed_agents: list[str] = Field(min_length=1)
    rate_limit: RateLimit | None = None
    audit: AuditSpec = AuditSpec()
    # Tool-specific settings, passed to the function's context (hosts, paths, ...).
    settings: dict[str, Any] = {}

    @field_validator("name")
    @classmethod
    def _name_is_subject_safe(cls, value: str) -> str:
        if not TOOL_NAME_PATTERN.fullmatch(value):
            raise ValueError("must match ^[a-z][a-z0-9_]{0,63}$ (it names a subject)")
        return value

    @field_validator("input_schema", "output_schema")
    @classmethod
    def _is_valid_json_schema(cls, value: dict[str, Any]) -> dict[str, Any]:
        import jsonschema_rs

        try:
            jsonschema_rs.validator_for(value)
        except Exception as exc:  # jsonschema_rs raises ValidationError / ValueError
            raise ValueError(f"not a valid JSON Schema: {exc}") from exc
        return value

    def agent_allowed(self, agent: str) -> bool:
        return "*" in self.allowed_agents or agent in self.allowed_agents


class Registry:
    """The loaded tools, by name, and a content hash that versions them."""

    def __init__(self, tools: dict[str, ToolSpec]) -> None:
        self._tools = dict(tools)
        canonical = json.dumps(
            {name: spec.model_dump(mode="json") for name, spec in sorted(tools.items())},
            sort_keys=True,
        )
        self.version = hashlib.sha256(canonical.encode()).hexdigest()[:16]

    def get(self, name: str) -> ToolSpec | None:
        return self._tools.get(name)

    def names(self) -> list[str]:
        return sorted(self._tools)

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self._tools.values())

    def __len__(self) -> int:
        return len(self._tools)


def load_tool_file(path: Path) -> ToolSpec:
    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise RegistryError(f"{path}: cannot read: {exc}") from exc
    if not isinstance(raw, dict):
        raise RegistryError(f"{path}: expected a mapping at the top level")
    try:
        return ToolSpec.model_validate(raw)
    except ValidationError as exc:
        problems = "; ".join(
            f"field '{'.'.join(str(p) for p in err['loc']) or '<root>'}': {err['msg']}"
            for err in exc.errors()
        )
        raise RegistryError(f"{path}: {problems}") from exc


def load_registry(*dirs: Path) -> Registry:
    """Load every `*.yaml` in `dirs` (later directories may add tools, never shadow one)."""
    tools: dict[str, ToolSpec] = {}
    for directory in dirs or (BUILTIN_TOOLS_DIR,):
        if not directory.is_dir():
            raise RegistryError(f"{directory}: not a directory")
        for path in sorted(directory.glob("*.yaml")):
            spec = load_tool_file(path)
            if spec.name in tools:
                raise RegistryError(f"{path}: tool '{spec.name}' is declared twice")
            tools[spec.name] = spec
    return Registry(tools)
