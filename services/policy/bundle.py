"""A policy bundle: a Cedar schema, Cedar policy files and an optional bundle.yaml.

Loading validates everything once (parse, schema validation, annotations)
and keeps the parsed schema and policy set, so no decision parses text. A
bad bundle is refused as a whole, each problem named by file and line. The
version is a hash of the files' content: the same files are the same
version on every replica.

Policy annotations the engine reads:
    @id("name")            required, unique in the bundle: names the policy in decisions
    @error_code("CODE")    the error code of a denial by this forbid (default POLICY_DENIED)
    @reason("text")        the message of that denial
    @approvers("N")        an approval policy: lifted by N distinct approvers (forbid only)
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import cedarpy
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from toolgate.contracts.calls import ErrorCode
from toolgate.services.policy.cedar_source import (
    error_location,
    split_statements,
    statement_error_location,
)
from toolgate.services.policy.providers import ProviderConfig, check_entity_type

SCHEMA_FILE = "schema.cedarschema"
SETTINGS_FILE = "bundle.yaml"
POLICY_SUFFIX = ".cedar"
# In the source tree (toolgate is installed editable); see the report on packaging.
DEFAULT_BUNDLE_DIR = Path(__file__).resolve().parents[2] / "infra" / "policies" / "default"

_FILE_NAME = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9_.-]{0,127}$")
_ERROR_CODE = re.compile(r"^[A-Z][A-Z0-9_]*$")


class BundleError(Exception):
    """A bundle that must not be loaded; the message names file, line and reason."""


class BundleSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    approval_ttl_s: float = Field(default=900.0, gt=0)
    roles: dict[str, list[str]] = {}
    # The clock policies read as context.local_time: each tenant's IANA time zone.
    time_zone: str = "UTC"
    tenant_time_zones: dict[str, str] = {}
    # Where each resource type's attributes come from (providers.py), by entity type.
    entities: dict[str, ProviderConfig] = {}

    @field_validator("time_zone")
    @classmethod
    def _zone_exists(cls, value: str) -> str:
        _zone(value)
        return value

    @field_validator("tenant_time_zones")
    @classmethod
    def _zones_exist(cls, value: dict[str, str]) -> dict[str, str]:
        for tenant, name in value.items():
            try:
                _zone(name)
            except ValueError as exc:
                raise ValueError(f"tenant {tenant}: {exc}") from exc
        return value

    @field_validator("entities")
    @classmethod
    def _entity_types(cls, value: dict[str, ProviderConfig]) -> dict[str, ProviderConfig]:
        for name in value:
            check_entity_type(name)
        return value

    def zone_of(self, tenant: str) -> ZoneInfo:
        return _zone(self.tenant_time_zones.get(tenant, self.time_zone))


@functools.lru_cache(maxsize=256)
def _zone(name: str) -> ZoneInfo:
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError) as exc:
        raise ValueError(
            f"{name!r} is not a known time zone (IANA name, e.g. Europe/Berlin)"
        ) from exc


@dataclass(frozen=True)
class PolicyInfo:
    policy_id: str
    effect: str
    error_code: str
    reason: str
    approvers: int  # 0: not an approval policy
    file: str
    line: int
    order: int  # position in the bundle: files by name, then statements
    # Whether `reason` is the policy's own @reason (else a stock sentence).
    has_reason: bool = False


@dataclass(frozen=True)
class PolicyBundle:
    version: str
    files: Mapping[str, str]
    settings: BundleSettings
    schema: cedarpy.Schema
    policy_set: cedarpy.PolicySet  # keyed by @id, so Cedar's reasons are the @ids
    policies: Mapping[str, PolicyInfo]


def is_bundle_file(name: str) -> bool:
    return name in (SCHEMA_FILE, SETTINGS_FILE) or name.endswith(POLICY_SUFFIX)


def bundle_version(files: Mapping[str, str]) -> str:
    digest = hashlib.sha256()
    for name in sorted(files):
        digest.update(f"{name}\0{files[name]}\0".encode())
    return digest.hexdigest()[:16]


def read_bundle_dir(directory: Path) -> dict[str, str]:
    if not directory.is_dir():
        raise BundleError(f"{directory}: not a directory")
    return {
        path.name: path.read_text(encoding="utf-8")
        for path in sorted(directory.iterdir())
        if path.is_file() and is_bundle_file(path.name)
    }


def load_bundle(directory: Path = DEFAULT_BUNDLE_DIR) -> PolicyBundle:
    return build_bundle(read_bundle_dir(directory))


def build_bundle(files: Mapping[str, str]) -> PolicyBundle:
    problems = [
        f"{name}: not a bundle file name"
        for name in files
        if not (_FILE_NAME.fullmatch(name) and is_bundle_file(name))
    ]
    if SCHEMA_FILE not in files:
        problems.append(f"{SCHEMA_FILE}: missing")
    policy_files = sorted(name for name in files if name.endswith(POLICY_SUFFIX))
    if not policy_files:
        problems.append(f"*{POLICY_SUFFIX}: no policy file")
    if problems:
        raise BundleError("\n".join(problems))
    settings = _settings(files.get(SETTINGS_FILE))
    schema = _schema(files[SCHEMA_FILE])
    policies: dict[str, PolicyInfo] = {}
    est: dict[str, Any] = {}
    for name in policy_files:
        problems += _add_policies(name, files[name], schema, policies, est)
    if problems:
        raise BundleError("\n".join(problems))
    policy_set = cedarpy.PolicySet.from_json_str(
        json.dumps({"staticPolicies": est, "templates": {}, "templateLinks": []})
    )
    return PolicyBundle(
        version=bundle_version(files),
        files=dict(files),
        settings=settings,
        schema=schema,
        policy_set=policy_set,
        policies=policies,
    )


def _settings(text: str | None) -> BundleSettings:
    if text is None:
        return BundleSettings()
    try:
        return BundleSettings.model_validate(yaml.safe_load(text) or {})
    except (yaml.YAMLError, ValidationError) as exc:
        raise BundleError(f"{SETTINGS_FILE}: {exc}") from exc


def _schema(text: str) -> cedarpy.Schema:
    try:
        return cedarpy.Schema.from_str(text)
    except ValueError as exc:
        where = error_location(text, cedarpy.Schema.from_str, str(exc))
        raise BundleError(f"{SCHEMA_FILE}:{where}: {exc}") from exc


def _add_policies(
    name: str,
    text: str,
    schema: cedarpy.Schema,
    policies: dict[str, PolicyInfo],
    est: dict[str, Any],
) -> list[str]:
    """Check one policy file; add its policies (keyed by @id) unless it has problems."""
    try:
        parsed = cedarpy.PolicySet.from_str(text)
    except ValueError as exc:
        return [f"{name}:{error_location(text, cedarpy.PolicySet.from_str, str(exc))}: {exc}"]
    statements = split_statements(text)

    def line_of(positional_id: str) -> int:
        # Cedar numbers the policies of one parse policy0, policy1, ... in order.
        index = int(positional_id.removeprefix("policy") or 0)
        return statements[index].line if index < len(statements) else 1

    def where(positional_id: str) -> str:
        return f"{name}:{line_of(positional_id)}"

    def where_error(positional_id: str, message: str) -> str:
        """file:line:column of what a validation error names, within its policy."""
        index = int(positional_id.removeprefix("policy") or 0)
        if index >= len(statements):
            return where(positional_id)
        return f"{name}:{statement_error_location(text, statements[index], message)}"

    pst = parsed.to_pst()
    problems = [
        f"{where(pid)}: templates (?principal/?resource slots) are not supported"
        for pid in pst.templates
    ]
    validation = cedarpy.validate_policies(text, schema)
    problems += [f"{where_error(e.policy_id, e.error)}: {e.error}" for e in validation.errors]
    found: dict[str, PolicyInfo] = {}
    for pid, policy in pst.static_policies.items():
        info, problem = _policy_info(policy.annotations, policy.effect, name, line_of(pid))
        if problem or info.policy_id in policies or info.policy_id in found:
            problems.append(f"{where(pid)}: {problem or f'@id {info.policy_id!r} is used twice'}")
            continue
        found[info.policy_id] = info
    if problems:
        return problems
    by_position = json.loads(cedarpy.policies_to_json_str(text))["staticPolicies"]
    for pid, policy in pst.static_policies.items():
        policy_id = policy.annotations["id"]
        policies[policy_id] = replace(found[policy_id], order=len(policies))
        est[policy_id] = by_position[pid]
    return []


def _policy_info(
    annotations: Mapping[str, str], effect: str, name: str, line: int
) -> tuple[PolicyInfo, str]:
    policy_id = annotations.get("id", "")
    error_code = annotations.get("error_code", ErrorCode.POLICY_DENIED)
    approvers = annotations.get("approvers", "0")
    problem = ""
    if not policy_id:
        problem = 'every policy needs an @id("...") annotation'
    elif not _ERROR_CODE.fullmatch(error_code):
        problem = f"@error_code {error_code!r} is not an UPPER_SNAKE code"
    elif not approvers.isdigit() or (effect != "forbid" and approvers != "0"):
        problem = f"@approvers {approvers!r} must be a count, on a forbid policy"
    info = PolicyInfo(
        policy_id=policy_id,
        effect=effect,
        error_code=error_code,
        reason=annotations.get("reason", f"denied by policy {policy_id!r}"),
        approvers=int(approvers) if approvers.isdigit() else 0,
        file=name,
        line=line,
        order=0,
        has_reason="reason" in annotations,
    )
    return info, problem
