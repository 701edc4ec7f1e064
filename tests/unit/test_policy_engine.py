"""The Cedar engine over the six-tuple: pure, no broker."""

from __future__ import annotations

from typing import Any

import pytest

from toolgate.contracts.calls import Principal, ToolCall
from toolgate.contracts.registry import Registry, ToolSpec, load_registry
from toolgate.services.policy.bundle import (
    DEFAULT_BUNDLE_DIR,
    SCHEMA_FILE,
    build_bundle,
    bundle_version,
    load_bundle,
    read_bundle_dir,
)
from toolgate.services.policy.engine import CedarEngine

ALICE = Principal(tenant="acme", user="u-alice", agent="researcher", session="s-1")
EVIDENCE = {"task_id": "task_c04", "claim": "x", "source_url": "https://example.org"}


@pytest.fixture(scope="module")
def registry() -> Registry:
    return load_registry()


@pytest.fixture(scope="module")
def engine() -> CedarEngine:
    return CedarEngine(load_bundle())


def call(
    tool: str,
    arguments: dict[str, Any],
    principal: Principal = ALICE,
    task_id: str | None = "task_c04",
) -> ToolCall:
    return ToolCall(
        call_id="call_1", tool=tool, arguments=arguments, principal=principal, task_id=task_id
    )


def spec(registry: Registry, tool: str, **changes: object) -> ToolSpec:
    found = registry.get(tool)
    assert found is not None
    return found.model_copy(update=changes)


def engine_with(policies: str, **extra_files: str) -> CedarEngine:
    """The default schema with these policies instead of the default ones."""
    files = {
        SCHEMA_FILE: read_bundle_dir(DEFAULT_BUNDLE_DIR)[SCHEMA_FILE],
        "test.cedar": policies,
        **extra_files,
    }
    return CedarEngine(build_bundle(files))


class TestDefaultBundle:
    def test_saving_into_the_calls_own_task_is_allowed(
        self, engine: CedarEngine, registry: Registry
    ) -> None:
        decision = engine.decide(call("save_evidence", EVIDENCE), registry.get("save_evidence"))
        assert decision.allowed and decision.status == "ok" and decision.error is None
        assert not decision.requires_approval

    def test_decisions_carry_the_bundle_version_and_the_deciding_policy_ids(
        self, engine: CedarEngine, registry: Registry
    ) -> None:
        allowed = engine.decide(call("echo", {"payload": 1}), registry.get("echo"))
        denied = engine.decide(
            call("save_evidence", {**EVIDENCE, "task_id": "t2"}), registry.get("save_evidence")
        )
        version = bundle_version(read_bundle_dir(DEFAULT_BUNDLE_DIR))
        assert allowed.policy_version == denied.policy_version == version
        assert allowed.policy_ids == ["registered-tool"]
        assert denied.policy_ids == ["task-scope"]

    def test_prompt_injected_task_id_is_a_task_scope_violation(
        self, engine: CedarEngine, registry: Registry
    ) -> None:
        # The model was told to save into a task its session does not own.
        decision = engine.decide(
            call("save_evidence", {**EVIDENCE, "task_id": "task_victim"}),
            registry.get("save_evidence"),
        )
        assert not decision.allowed and decision.error is not None
        assert decision.error.code == "TASK_SCOPE_VIOLATION"
        assert "task_victim" in decision.error.message

    def test_task_scoped_call_without_a_task_of_its_own_is_denied(
        self, engine: CedarEngine, registry: Registry
    ) -> None:
        decision = engine.decide(
            call("save_evidence", EVIDENCE, task_id=None), registry.get("save_evidence")
        )
        assert decision.error is not None and decision.error.code == "TASK_SCOPE_VIOLATION"

    def test_task_of_another_tenant_is_denied(self, registry: Registry) -> None:
        # The task directory knows task_c04 belongs to globex, whatever the call claims.
        engine = CedarEngine(load_bundle(), tasks={"task_c04": "globex"}.get)
        decision = engine.decide(call("save_evidence", EVIDENCE), registry.get("save_evidence"))
        assert not decision.allowed and decision.policy_ids == ["tenant-isolation"]
        assert decision.error is not None and decision.error.code == "POLICY_DENIED"

    def test_agent_not_in_allowed_agents_is_denied(
        self, engine: CedarEngine, registry: Registry
    ) -> None:
        bot = Principal(tenant="acme", user="u-alice", agent="browser-bot", session="s-1")
        decision = engine.decide(
            call("save_evidence", EVIDENCE, principal=bot), registry.get("save_evidence")
        )
        assert decision.error is not None and decision.error.code == "TOOL_NOT_ALLOWED"
        assert decision.policy_ids == ["allowed-agents"]

    def test_any_agent_may_use_a_tool_open_to_all(
        self, engine: CedarEngine, registry: Registry
    ) -> None:
        bot = Principal(tenant="acme", user="u-alice", agent="browser-bot", session="s-1")
        assert engine.decide(call("echo", {}, principal=bot), registry.get("echo")).allowed

    def test_principal_without_a_session_is_denied(
        self, engine: CedarEngine, registry: Registry
    ) -> None:
        anonymous = Principal(tenant="acme", user="u-alice", agent="researcher", session="")
        decision = engine.decide(call("echo", {}, principal=anonymous), registry.get("echo"))
        assert decision.policy_ids == ["principal-known"]

    def test_unknown_tool_is_denied_with_its_name(self, engine: CedarEngine) -> None:
        decision = engine.decide(call("rm_rf", {}), None)
        assert not decision.allowed and decision.error is not None
        assert decision.error.code == "TOOL_NOT_ALLOWED" and "rm_rf" in decision.error.message


class TestApproval:
    def test_critical_tool_needs_two_distinct_approvers(
        self, engine: CedarEngine, registry: Registry
    ) -> None:
        critical = spec(registry, "echo", risk="critical")
        asked = engine.decide(call("echo", {}), critical)
        assert asked.awaits_approval and asked.required_approvals == 2
        assert asked.policy_ids == ["approval-critical"]
        assert asked.error is not None and asked.error.code == "APPROVAL_REQUIRED"
        assert engine.decide(call("echo", {}), critical, ["ann", "ann"]).awaits_approval
        granted = engine.decide(call("echo", {}), critical, ["ann", "bob"])
        assert granted.allowed and granted.requires_approval and granted.required_approvals == 2
        assert granted.policy_ids == ["approval-critical", "registered-tool"]

    def test_high_risk_tool_needs_one_approver(
        self, engine: CedarEngine, registry: Registry
    ) -> None:
        decision = engine.decide(call("echo", {}), spec(registry, "echo", risk="high"))
        assert decision.awaits_approval and decision.required_approvals == 1

    def test_registry_requires_approval_even_if_the_bundle_forgets(
        self, registry: Registry
    ) -> None:
        lax = engine_with('@id("all") permit (principal, action, resource);')
        decision = lax.decide(call("echo", {}), spec(registry, "echo", requires_approval=True))
        assert decision.awaits_approval and decision.required_approvals == 1
        assert lax.decide(call("echo", {}), spec(registry, "echo")).allowed

    def test_call_no_approval_could_allow_is_denied_without_asking(
        self, engine: CedarEngine, registry: Registry
    ) -> None:
        bot = Principal(tenant="acme", user="u-alice", agent="browser-bot", session="s-1")
        critical = spec(registry, "save_evidence", risk="critical")
        decision = engine.decide(call("save_evidence", EVIDENCE, principal=bot), critical)
        assert not decision.awaits_approval
        assert decision.error is not None and decision.error.code == "TOOL_NOT_ALLOWED"

    def test_why_is_the_approval_rules_own_reason_when_it_gives_one(
        self, registry: Registry
    ) -> None:
        gated = engine_with(
            '@id("all") permit (principal, action, resource);\n'
            '@id("gate") @approvers("1") @reason("echoes at high risk are read by a human")\n'
            'forbid (principal, action, resource) when { context.risk == "high" }\n'
            'unless { context.approval.state == "granted" };'
        )
        decision = gated.decide(call("echo", {}), spec(registry, "echo", risk="high"))
        assert decision.awaits_approval
        assert decision.approval_reason == "echoes at high risk are read by a human"
        silent = engine_with(
            '@id("all") permit (principal, action, resource);\n'
            '@id("gate") @approvers("1")\n'
            'forbid (principal, action, resource) when { context.risk == "high" }\n'
            'unless { context.approval.state == "granted" };'
        )
        decision = silent.decide(call("echo", {}), spec(registry, "echo", risk="high"))
        assert decision.awaits_approval and decision.approval_reason == ""
        assert decision.error is not None and "needs 1 distinct" in decision.error.message

    def test_approval_policy_that_ignores_the_grant_keeps_denying(self, registry: Registry) -> None:
        stubborn = engine_with(
            '@id("all") permit (principal, action, resource);\n'
            '@id("gate") @approvers("1") @error_code("APPROVAL_REQUIRED")\n'
            'forbid (principal, action, resource) when { context.risk == "high" };'
        )
        decision = stubborn.decide(call("echo", {}), spec(registry, "echo", risk="high"), ["a"])
        assert not decision.allowed and not decision.awaits_approval
        assert decision.policy_ids == ["gate"]


class TestCedarSemantics:
    def test_forbid_beats_permit(self, registry: Registry) -> None:
        engine = engine_with(
            '@id("everyone") permit (principal, action in Action::"call", resource);\n'
            '@id("no-echo") @error_code("TOOL_NOT_ALLOWED")\n'
            'forbid (principal, action, resource == Tool::"echo");'
        )
        decision = engine.decide(call("echo", {}), registry.get("echo"))
        assert not decision.allowed and decision.policy_ids == ["no-echo"]
        assert engine.decide(call("search_sources", {}), registry.get("search_sources")).allowed

    def test_nothing_permitted_is_denied_by_default(self, registry: Registry) -> None:
        engine = engine_with(
            '@id("only-reads") permit (principal, action == Action::"read", resource);'
        )
        decision = engine.decide(call("save_evidence", EVIDENCE), registry.get("save_evidence"))
        assert not decision.allowed and decision.policy_ids == []
        assert decision.error is not None and decision.error.code == "POLICY_DENIED"

    def test_missing_entity_is_a_deny_with_the_reason(self, registry: Registry) -> None:
        # The only forbid reads the tenant of a task nobody knows: Cedar skips an
        # erroring policy, which would let the permit through; the engine denies.
        engine = engine_with(
            '@id("all") permit (principal, action, resource);\n'
            '@id("tenant") forbid (principal, action, resource is Task)\n'
            "when { resource.tenant != principal.tenant };"
        )
        decision = engine.decide(
            call("save_evidence", {**EVIDENCE, "task_id": "task_x"}), registry.get("save_evidence")
        )
        assert not decision.allowed and decision.error is not None
        assert decision.error.code == "POLICY_ERROR"
        assert 'Task::"task_x"' in decision.error.message
        assert "does not exist" in decision.error.message

    def test_roles_come_from_the_bundle_not_the_call(self, registry: Registry) -> None:
        engine = engine_with(
            '@id("writers-write") permit (principal, action == Action::"write", resource)\n'
            'when { principal.roles.contains("writer") };',
            **{"bundle.yaml": "roles: {acme/u-alice: [writer]}\n"},
        )
        bob = Principal(tenant="acme", user="u-bob", agent="researcher", session="s-2")
        save = registry.get("save_evidence")
        assert engine.decide(call("save_evidence", EVIDENCE), save).allowed
        assert not engine.decide(call("save_evidence", EVIDENCE, principal=bob), save).allowed

    def test_policies_may_read_scalar_arguments(self, registry: Registry) -> None:
        engine = engine_with(
            '@id("all") permit (principal, action, resource);\n'
            '@id("small-searches") forbid (principal, action, resource)\n'
            "when { context.arguments has limit && context.arguments.limit > 5 };"
        )
        search = registry.get("search_sources")
        assert engine.decide(call("search_sources", {"limit": 5}), search).allowed
        assert not engine.decide(call("search_sources", {"limit": 6}), search).allowed


class TestCallEntities:
    """A call's entities (its tool's base plus its user, agent and tasks) are parsed once
    per distinct set: calls of one agent in one task reuse them; anything that differs
    (another user, another tool version) gets its own."""

    def test_calls_with_the_same_entities_share_one_parse_and_others_do_not(
        self, registry: Registry
    ) -> None:
        engine = CedarEngine(load_bundle())
        save = spec(registry, "save_evidence")
        first = engine._prepare(call("save_evidence", EVIDENCE), save, None).entities
        again = engine._prepare(call("save_evidence", {**EVIDENCE, "claim": "y"}), save, None)
        assert again.entities is first  # other arguments, the same entities: parsed once
        bob = Principal(tenant="acme", user="u-bob", agent="researcher", session="s-2")
        other = engine._prepare(call("save_evidence", EVIDENCE, principal=bob), save, None)
        assert other.entities is not first
        changed = spec(registry, "save_evidence", risk="high")  # a pushed version of it
        newer = engine._prepare(call("save_evidence", EVIDENCE), changed, None).entities
        assert newer is not first
        assert engine.decide(call("save_evidence", EVIDENCE), save).allowed
