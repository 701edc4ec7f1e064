"""Resources, actions and the seed's context in decisions: the orders example's bundle
and registry, decided by the engine on what the entity providers said (no I/O here)."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from toolgate.contracts.calls import Principal, ToolCall
from toolgate.contracts.events import ResourceSeen
from toolgate.contracts.registry import (
    RegistryError,
    ToolSpec,
    load_registry,
    load_tool_file,
)
from toolgate.infra.examples import orders
from toolgate.services.policy.bundle import (
    DEFAULT_BUNDLE_DIR,
    SCHEMA_FILE,
    SETTINGS_FILE,
    BundleError,
    build_bundle,
    read_bundle_dir,
)
from toolgate.services.policy.engine import CedarEngine, registry_approvers
from toolgate.services.policy.resources import ResourceProblem, resource_refs

ALICE = Principal(tenant="acme", user="u-alice", agent="support", session="s-1")
BOB = Principal(tenant="acme", user="u-bob", agent="support", session="s-2")
ORDERS = load_registry(orders.REGISTRY_DIR)
QUERY, REFUND = ORDERS.get("query_order"), ORDERS.get("refund_order")
assert QUERY is not None and REFUND is not None


def at(text: str) -> float:
    """An instant, as epoch seconds (the engine's clock)."""
    return datetime.fromisoformat(text).timestamp()


# Wednesday 2026-12-02: 10:00 and 03:00 on acme's clock (Europe/Berlin, UTC+1 in winter).
WORKING_HOURS = at("2026-12-02T09:00:00+00:00")
NIGHT = at("2026-12-02T02:00:00+00:00")
SATURDAY_NOON = at("2026-12-05T11:00:00+00:00")


def engine(now: float = WORKING_HOURS, files: dict[str, str] | None = None) -> CedarEngine:
    return CedarEngine(build_bundle(files or read_bundle_dir(orders.POLICY_DIR)), clock=lambda: now)


def order(
    order_id: str,
    owner: str,
    amount: int = 1200,
    refunded: int = 0,
    tenant: str = "acme",
    **extra: Any,
) -> ResourceSeen:
    return ResourceSeen(
        type="Order",
        id=order_id,
        found=True,
        provider="sql",
        attributes={
            "owner": owner,
            "tenant": tenant,
            "status": "delivered",
            "amount": amount,
            "refunded": refunded,
            "currency": "EUR",
            **extra,
        },
        fetched_at=datetime.now(UTC),
    )


O1001 = order("o-1001", "u-alice")
O2002 = order("o-2002", "u-bob", amount=300)


def call(
    tool: str,
    arguments: dict[str, Any],
    principal: Principal = ALICE,
    context: dict[str, Any] | None = None,
) -> ToolCall:
    return ToolCall(
        call_id="c1", tool=tool, arguments=arguments, principal=principal, context=context or {}
    )


def refund(amount: int, session_kind: str | None = None, order_id: str = "o-1001") -> ToolCall:
    context = {} if session_kind is None else {"session_kind": session_kind}
    return call("refund_order", {"order_id": order_id, "amount": amount}, context=context)


class TestRegistry:
    def test_tools_declare_their_action_and_resources(self) -> None:
        assert QUERY.action_class == "read" and REFUND.action_class == "write"
        assert [(r.type, r.id) for r in REFUND.resources] == [("Order", "/order_id")]

    def test_undeclared_action_comes_from_read_only(self) -> None:
        builtin = load_registry()
        assert builtin.get("echo").action_class == "read"  # type: ignore[union-attr]
        assert builtin.get("save_evidence").action_class == "write"  # type: ignore[union-attr]
        assert all(spec.resources == [] for spec in builtin)

    @pytest.mark.parametrize(
        ("change", "problem"),
        [
            ({"read_only": True, "action": "delete"}, "a read_only tool cannot declare action"),
            ({"action": "launch"}, "action"),
            ({"resources": [{"type": "Order", "id": "/nope"}]}, "must point at a string"),
            ({"resources": [{"type": "Order", "id": "/amount"}]}, "must point at a string"),
            ({"resources": [{"type": "Order", "id": "order_id"}]}, "resources.0.id"),
            ({"resources": [{"type": "Task", "id": "/order_id"}]}, "built by the policy engine"),
            ({"resources": [{"type": "order", "id": "/order_id"}]}, "resources.0.type"),
            ({"resources": [{"type": "Order", "id": "/order_id"}] * 2}, "declared twice"),
        ],
    )
    def test_a_bad_declaration_stops_start_up_naming_it(
        self, tmp_path: Path, change: dict[str, Any], problem: str
    ) -> None:
        import yaml

        raw = yaml.safe_load((orders.REGISTRY_DIR / "refund_order.yaml").read_text())
        path = tmp_path / "refund_order.yaml"
        path.write_text(yaml.safe_dump({**raw, **change}))
        with pytest.raises(RegistryError) as raised:
            load_tool_file(path)
        assert problem in str(raised.value) and str(path) in str(raised.value)

    def test_a_list_of_ids_names_several_resources(self) -> None:
        spec = REFUND.model_copy(update={"resources": []})
        schema = {
            "type": "object",
            "properties": {"order_ids": {"type": "array", "items": {"type": "string"}}},
        }
        several = ToolSpec.model_validate(
            {
                **spec.model_dump(),
                "input_schema": schema,
                "resources": [{"type": "Order", "id": "/order_ids"}],
            }
        )
        refs = resource_refs(call("x", {"order_ids": ["o-1", "o-2", "o-1"]}), several)
        assert refs == [("Order", "o-1"), ("Order", "o-2")]
        with pytest.raises(ResourceProblem, match="names no Order"):
            resource_refs(call("x", {"order_ids": []}), several)
        with pytest.raises(ResourceProblem, match="non-empty string"):
            resource_refs(call("x", {"order_ids": [7]}), several)


class TestOwnership:
    """The seed: a support agent acting for user X reads order Z only if Z is X's."""

    def test_alice_reads_her_own_order(self) -> None:
        decision = engine().decide(
            call("query_order", {"order_id": "o-1001"}), QUERY, resources=[O1001]
        )
        assert decision.allowed and not decision.requires_approval, decision
        assert decision.policy_ids == ["registered-tool"]

    def test_alice_cannot_read_bobs_order(self) -> None:
        decision = engine().decide(
            call("query_order", {"order_id": "o-2002"}), QUERY, resources=[O2002]
        )
        assert not decision.allowed and not decision.awaits_approval
        assert decision.error is not None and decision.error.code == "NOT_RESOURCE_OWNER"
        assert "belongs to another user" in decision.error.message
        assert "resource Order 'o-2002'" in decision.error.message
        assert decision.policy_ids == ["orders-owner-only"]
        mine = engine().decide(
            call("query_order", {"order_id": "o-2002"}, principal=BOB), QUERY, resources=[O2002]
        )
        assert mine.allowed

    def test_an_order_of_another_tenant_is_denied_even_with_the_same_user_id(self) -> None:
        foreign = order("o-1001", "u-alice", tenant="globex")
        decision = engine().decide(
            call("query_order", {"order_id": "o-1001"}), QUERY, resources=[foreign]
        )
        assert not decision.allowed and decision.policy_ids == ["orders-tenant-isolation"]

    def test_only_the_support_agent_works_on_orders(self) -> None:
        other = Principal(tenant="acme", user="u-alice", agent="researcher", session="s-1")
        decision = engine().decide(
            call("query_order", {"order_id": "o-1001"}, principal=other), QUERY, resources=[O1001]
        )
        assert not decision.allowed and decision.error is not None
        assert decision.error.code == "TOOL_NOT_ALLOWED"


class TestFailClosed:
    def test_an_unknown_order_is_denied(self) -> None:
        unknown = ResourceSeen(type="Order", id="o-9999", provider="sql")
        decision = engine().decide(
            call("query_order", {"order_id": "o-9999"}), QUERY, resources=[unknown]
        )
        assert not decision.allowed and decision.error is not None
        assert decision.error.code == "POLICY_DENIED" and not decision.error.retryable
        assert "Order 'o-9999' is not known" in decision.error.message

    def test_a_failed_lookup_is_a_retryable_deny_with_its_reason(self) -> None:
        failed = ResourceSeen(
            type="Order",
            id="o-1001",
            provider="sql",
            error="the sql provider failed: cannot open orders.sqlite3",
        )
        decision = engine().decide(
            call("query_order", {"order_id": "o-1001"}), QUERY, resources=[failed]
        )
        assert not decision.allowed and decision.error is not None
        assert decision.error.code == "POLICY_ERROR" and decision.error.retryable
        assert "cannot open orders.sqlite3" in decision.error.message

    @pytest.mark.parametrize("resources", [None, [], [order("o-2002", "u-alice")]])
    def test_a_resource_nobody_looked_up_is_denied(
        self, resources: list[ResourceSeen] | None
    ) -> None:
        decision = engine().decide(
            call("query_order", {"order_id": "o-1001"}), QUERY, resources=resources
        )
        assert not decision.allowed and decision.error is not None
        assert "'o-1001' was not looked up" in decision.error.message

    def test_an_attribute_cedar_cannot_hold_is_a_deny(self) -> None:
        odd = order("o-1001", "u-alice", weight=1.23456789)
        decision = engine().decide(
            call("query_order", {"order_id": "o-1001"}), QUERY, resources=[odd]
        )
        assert not decision.allowed and decision.error is not None
        assert "attribute weight of Order 'o-1001'" in decision.error.message

    def test_a_null_attribute_is_absent_so_a_policy_reading_it_denies(self) -> None:
        ownerless = order("o-1001", None)  # type: ignore[arg-type]
        decision = engine().decide(
            call("query_order", {"order_id": "o-1001"}), QUERY, resources=[ownerless]
        )
        assert not decision.allowed and decision.error is not None
        assert decision.error.code == "POLICY_ERROR"

    def test_a_session_kind_the_policy_does_not_know_is_denied(self) -> None:
        decision = engine().decide(refund(10, session_kind="batch"), REFUND, resources=[O1001])
        assert not decision.allowed and decision.error is not None
        assert (
            "context.session_kind must be one of interactive, automated" in decision.error.message
        )


class TestRefunds:
    def test_a_small_interactive_refund_in_working_hours_needs_one_approver(self) -> None:
        decision = engine().decide(refund(100, "interactive"), REFUND, resources=[O1001])
        assert decision.awaits_approval and decision.required_approvals == 1
        assert decision.policy_ids == ["approval-high-risk", "approval-side-effects"]

    def test_a_refund_above_500_needs_two_approvers(self) -> None:
        decision = engine().decide(refund(900, "interactive"), REFUND, resources=[O1001])
        assert decision.awaits_approval and decision.required_approvals == 2
        assert "refund-two-approvers-above-500" in decision.policy_ids
        assert "refunds above 500 need two approvers" in (
            decision.error.message if decision.error else ""
        )

    @pytest.mark.parametrize("now", [NIGHT, SATURDAY_NOON])
    def test_an_automated_refund_outside_working_hours_needs_two(self, now: float) -> None:
        decision = engine(now).decide(refund(100, "automated"), REFUND, resources=[O1001])
        assert decision.awaits_approval and decision.required_approvals == 2
        assert "refund-automated-off-hours" in decision.policy_ids
        interactive = engine(now).decide(refund(100, "interactive"), REFUND, resources=[O1001])
        assert interactive.required_approvals == 1

    def test_an_unstated_session_counts_as_automated(self) -> None:
        decision = engine(NIGHT).decide(refund(100), REFUND, resources=[O1001])
        assert decision.required_approvals == 2

    def test_an_automated_refund_in_working_hours_needs_one(self) -> None:
        decision = engine(WORKING_HOURS).decide(refund(100, "automated"), REFUND, resources=[O1001])
        assert decision.required_approvals == 1

    def test_working_hours_are_the_tenants_own(self) -> None:
        # 07:30 UTC is 08:30 in Berlin (acme): working hours there, not in UTC.
        files = read_bundle_dir(orders.POLICY_DIR)
        morning = at("2026-12-02T07:30:00+00:00")
        assert (
            engine(morning, files)
            .decide(refund(100, "automated"), REFUND, resources=[O1001])
            .required_approvals
            == 1
        )
        files[SETTINGS_FILE] = files[SETTINGS_FILE].replace("acme: Europe/Berlin", "acme: UTC")
        assert (
            engine(morning, files)
            .decide(refund(100, "automated"), REFUND, resources=[O1001])
            .required_approvals
            == 2
        )

    def test_two_approvers_allow_the_900_night_refund(self) -> None:
        decision = engine(NIGHT).decide(
            refund(900, "automated"), REFUND, ["ann", "bea"], resources=[O1001]
        )
        assert decision.allowed and decision.required_approvals == 2
        one = engine(NIGHT).decide(refund(900, "automated"), REFUND, ["ann"], resources=[O1001])
        assert one.awaits_approval

    def test_a_refund_beyond_what_is_left_is_denied_without_asking(self) -> None:
        mostly_refunded = order("o-1001", "u-alice", amount=1200, refunded=1000)
        decision = engine().decide(refund(300, "interactive"), REFUND, resources=[mostly_refunded])
        assert not decision.allowed and not decision.awaits_approval
        assert decision.policy_ids == ["refund-within-order"]

    def test_refunding_bobs_order_is_denied_whatever_the_approvals(self) -> None:
        decision = engine().decide(
            refund(100, "interactive", order_id="o-2002"), REFUND, ["ann", "bea"], resources=[O2002]
        )
        assert not decision.allowed and decision.policy_ids == ["orders-owner-only"]


class TestSideEffectRule:
    """The seed: any delete/write/send/publish/execute tool at risk high or critical
    requires approval, whatever else it declares (and whatever the bundle says)."""

    @pytest.mark.parametrize("action", ["write", "delete", "send", "publish", "execute"])
    def test_side_effects_at_high_risk_need_a_human(self, action: str) -> None:
        spec = REFUND.model_copy(
            update={"action": action, "resources": [], "requires_approval": False}
        )
        assert registry_approvers(spec) == 1
        lax = CedarEngine(
            build_bundle(
                {
                    SCHEMA_FILE: read_bundle_dir(DEFAULT_BUNDLE_DIR)[SCHEMA_FILE],
                    "lax.cedar": '@id("all") permit (principal, action, resource);',
                }
            )
        )
        decision = lax.decide(call("refund_order", {"order_id": "o", "amount": 1}), spec)
        assert decision.awaits_approval and decision.required_approvals == 1

    def test_the_default_bundle_names_the_rule(self) -> None:
        default = CedarEngine(build_bundle(read_bundle_dir(DEFAULT_BUNDLE_DIR)))
        spec = REFUND.model_copy(
            update={
                "action": "publish",
                "risk": "critical",
                "resources": [],
                "allowed_agents": ["*"],
            }
        )
        decision = default.decide(call("refund_order", {"order_id": "o", "amount": 1}), spec)
        assert "approval-side-effects" in decision.policy_ids
        assert decision.required_approvals == 2  # critical: two

    def test_a_high_risk_read_is_not_held_by_this_rule(self) -> None:
        spec = QUERY.model_copy(update={"risk": "high", "resources": []})
        assert registry_approvers(spec) == 0


class TestSchemas:
    def test_a_bundle_written_before_session_kind_and_local_time_still_loads(self) -> None:
        schema = read_bundle_dir(DEFAULT_BUNDLE_DIR)[SCHEMA_FILE]
        old = (
            schema.replace("  session_kind: String,\n", "")
            .replace("  local_time: LocalTime,\n", "")
            .replace(
                "action read, write, send, delete, publish, execute in",
                "action read, write, send, delete in",
            )
        )
        assert old != schema
        engine = CedarEngine(
            build_bundle(
                {SCHEMA_FILE: old, "a.cedar": ('@id("all") permit (principal, action, resource);')}
            )
        )
        assert not engine.features.session_kind and not engine.features.local_time
        assert "publish" not in engine.features.actions
        spec = load_registry().get("echo")
        assert engine.decide(call("echo", {"payload": 1}), spec).allowed

    def test_a_policy_may_read_the_local_time_and_session_kind(self) -> None:
        schema = read_bundle_dir(DEFAULT_BUNDLE_DIR)[SCHEMA_FILE]
        files = {
            SCHEMA_FILE: schema,
            "a.cedar": (
                '@id("all") permit (principal, action, resource);\n'
                '@id("weekend") forbid (principal, action, resource)\n'
                'when { context.local_time.weekday == "saturday" && '
                'context.session_kind == "automated" };'
            ),
            SETTINGS_FILE: "time_zone: Pacific/Auckland\n",
        }
        spec = load_registry().get("echo")
        # Friday 2026-12-04 12:00 UTC is Saturday 01:00 in Auckland.
        friday_utc = CedarEngine(build_bundle(files), clock=lambda: at("2026-12-04T12:00:00Z"))
        automated = call("echo", {"payload": 1}, context={"session_kind": "automated"})
        assert not friday_utc.decide(automated, spec).allowed
        assert friday_utc.decide(call("echo", {"payload": 1}), spec).allowed

    def test_the_example_bundle_is_the_default_bundle_plus_orders(self) -> None:
        default, example = read_bundle_dir(DEFAULT_BUNDLE_DIR), read_bundle_dir(orders.POLICY_DIR)
        for name in ("agents.cedar", "approvals.cedar", "tasks.cedar"):
            assert example[name] == default[name], f"{name} drifted from the default bundle"

    def test_a_bad_time_zone_or_provider_is_refused_at_load(self) -> None:
        files = read_bundle_dir(orders.POLICY_DIR)
        for bad, why in (
            ("acme: Europe/Berlin", "acme: Mars/Olympus"),
            ("provider: sql", "provider: ftp"),
            ("WHERE id = :id", "WHERE id = 'o-1001'"),
        ):
            with pytest.raises(BundleError, match=SETTINGS_FILE):
                build_bundle({**files, SETTINGS_FILE: files[SETTINGS_FILE].replace(bad, why)})


def test_a_recorded_decision_is_decided_again_on_what_was_known_then() -> None:
    import msgspec

    from toolgate.contracts.events import CallDenied
    from toolgate.services.policy.resources import recorded_resources

    denied = engine().decide(call("query_order", {"order_id": "o-2002"}), QUERY, resources=[O2002])
    event = CallDenied(
        event_id="e",
        call_id="c1",
        occurred_at=datetime.now(UTC),
        service="policy",
        status="denied",
        error=denied.error,  # type: ignore[arg-type]
        resources=[O2002],
    )
    document = msgspec.json.decode(msgspec.json.encode(event))  # as the audit stores it
    again = engine().decide(
        call("query_order", {"order_id": "o-2002"}), QUERY, resources=recorded_resources(document)
    )
    assert again.policy_ids == denied.policy_ids == ["orders-owner-only"]
    assert recorded_resources({"resources": []}) is None


def test_policy_test_re_decides_on_the_resources_the_decision_recorded() -> None:
    from toolgate.cli.policy_history import ALLOW, DENY, UNCHANGED, Recorded, compare

    read_own = call("query_order", {"order_id": "o-1001"})
    recorded = Recorded("c1", "query_order", "support", ALLOW, call=read_own, resources=[O1001])
    assert compare(recorded, engine(), ORDERS).kind == UNCHANGED
    # Without what was known then, the candidate could not see the owner: a deny.
    blind = Recorded("c1", "query_order", "support", ALLOW, call=read_own)
    assert compare(blind, engine(), ORDERS).candidate == DENY
