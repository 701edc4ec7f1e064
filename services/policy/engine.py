"""The Cedar policy engine: one loaded bundle, decisions over the six-tuple.

Parsed once: the bundle holds a parsed `cedarpy.PolicySet` (keyed by @id)
and `Schema`; each tool's entity and the action hierarchy are parsed once
into an `Entities` handle, and a call adds only its own user, agent and tasks
(`with_added_json_str` parses just that delta).

How a call is judged:
0. Every argument must fit the Cedar context (entities.py); one that does
   not (a float, an integer beyond 64 bits, a very long string, ...) denies
   the call (POLICY_DENIED, naming the argument): never dropped unseen. So
   must the session kind the platform states. Each resource the tool declares
   must have been looked up and found (resources.py; the service looks them
   up through the bundle's entity providers and passes what they said): an
   unknown resource is POLICY_DENIED, a failed lookup POLICY_ERROR
   (retryable), each with its reason.
1. Evaluate with no approval, once per resource (the Task or Tool when the
   tool declares none); every evaluation must allow. A forbid that is not an approval policy, any
   evaluation error, or no permit at all: denied. Cedar skips a policy whose
   evaluation errors (a forbid too), so an error is a deny here, never an allow.
2. If only approval policies forbid, or the registry insists (requires_approval,
   risk critical, or a write, delete, send, publish or execute tool at risk high:
   at least one approver whatever the bundle says), the call
   needs N distinct approvers, N the largest @approvers among them.
3. Evaluate again with approval granted: with the real approvers once N have
   said yes (allowed or denied under the policy as it is now), else
   hypothetically, so a call no approval could allow is denied at once
   instead of being put before a human.

There is no evaluation timeout: Cedar has no loops or recursion, so an
evaluation always ends, in time linear in the policies' size.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import cedarpy
import msgspec

from toolgate.contracts.calls import ErrorCode, Principal, ToolCall, ToolError
from toolgate.contracts.events import ResourceSeen
from toolgate.contracts.registry import SIDE_EFFECT_ACTIONS, ToolSpec
from toolgate.services.policy.bundle import (
    SCHEMA_FILE,
    BundleError,
    PolicyBundle,
    PolicyInfo,
    build_bundle,
)
from toolgate.services.policy.entities import (
    FINER_ACTIONS,
    NO_APPROVAL,
    ApprovalState,
    InvalidContext,
    TaskTenants,
    Unrepresentable,
    action_entities,
    call_entities,
    local_time,
    request_for,
    session_kind_of,
    task_target,
    tool_entity,
    uid,
)
from toolgate.services.policy.resources import (
    ResourceProblem,
    known_resources,
    resource_entity,
    resource_refs,
)
from toolgate.services.policy.rules import Decision

MAX_MESSAGE_CHARS = 2000
# Parsed call entities kept per engine (see CedarEngine._entities).
CALL_ENTITIES_KEPT = 512
_json = msgspec.json.Encoder()


def registry_approvers(spec: ToolSpec) -> int:
    """The approvers the registry demands whatever a bundle says (the seed's rule: a tool
    with a side effect at risk high or critical is never run without a human)."""
    side_effect_high = spec.action_class in SIDE_EFFECT_ACTIONS and spec.risk in (
        "high",
        "critical",
    )
    return 1 if spec.requires_approval or spec.risk == "critical" or side_effect_high else 0


@dataclass(frozen=True)
class SchemaFeatures:
    """What the bundle's schema declares beyond the base the engine always sends.

    A bundle written before these existed keeps loading: the engine sends
    session_kind and local_time only to a schema that declares them (a policy
    could not read them otherwise: it would not validate), and checks only
    the actions the schema declares.
    """

    session_kind: bool = False
    local_time: bool = False
    actions: tuple[str, ...] = FINER_ACTIONS


@dataclass
class Prepared:
    """One call, made ready for Cedar once per decision (every evaluation shares it)."""

    entities: cedarpy.Entities
    targets: list[dict[str, str]]  # the resource of each evaluation
    context: dict[str, Any]  # without `approval`


class CedarEngine:
    def __init__(
        self,
        bundle: PolicyBundle,
        tasks: TaskTenants | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.bundle = bundle
        self.version = bundle.version
        self._tasks = tasks
        self._clock = clock
        self._tool_entities: dict[str, tuple[ToolSpec, cedarpy.Entities]] = {}
        # A call's entities (its tool's base plus its own delta), by the delta's JSON: the
        # calls of one agent, user and task repeat it, and parsing it was 6 % of the
        # policy's CPU in a burst. Kept with the base they were built on (a tool changed
        # by a pushed registry has a new base: no entry of the old one is used).
        self._call_entities: dict[str, tuple[cedarpy.Entities, cedarpy.Entities]] = {}
        self.features = check_engine_fits_schema(bundle)

    def decide(
        self,
        call: ToolCall,
        spec: ToolSpec | None,
        approvers: Sequence[str] = (),
        resources: Sequence[ResourceSeen] | None = None,
    ) -> Decision:
        """The decision on `call`; `resources`: what the entity providers said of the
        resources the tool declares (a tool that declares some is denied without them)."""
        if spec is None:
            return self._deny(
                ErrorCode.TOOL_NOT_ALLOWED, f"tool {call.tool!r} is not registered here", []
            )
        try:
            return self._decide(call, spec, approvers, resources)
        except Unrepresentable as exc:  # a policy must not decide without it: deny
            return self._deny(
                ErrorCode.POLICY_DENIED, f"{exc}, so the policy cannot evaluate this call", []
            )
        except InvalidContext as exc:
            return self._deny(
                ErrorCode.POLICY_DENIED, f"{exc}, so the policy cannot evaluate this call", []
            )
        except ResourceProblem as exc:
            code = ErrorCode.POLICY_ERROR if exc.retryable else ErrorCode.POLICY_DENIED
            return self._deny(code, str(exc), [], retryable=exc.retryable)
        except Exception as exc:  # fail closed
            return self._deny(ErrorCode.POLICY_ERROR, f"policy evaluation failed: {exc!r}", [])

    def _decide(
        self,
        call: ToolCall,
        spec: ToolSpec,
        approvers: Sequence[str],
        resources: Sequence[ResourceSeen] | None,
    ) -> Decision:
        prepared = self._prepare(call, spec, resources)
        first = self._evaluate(call, spec, NO_APPROVAL, prepared)
        denial = self._denial(first, call, spec, approvals_lift=True)
        if denial is not None:
            return denial
        gates = self._policies(
            list(
                dict.fromkeys(
                    reason
                    for _, result in first
                    if not result.allowed
                    for reason in result.diagnostics.reasons
                )
            )
        )
        required = max([g.approvers for g in gates] + [registry_approvers(spec)])
        if required == 0:
            return self._allow(first)
        distinct = tuple(sorted(set(approvers)))
        granted = len(distinct) >= required
        approval = (
            ApprovalState("granted", distinct, len(distinct))
            if granted
            else ApprovalState("granted", (), required)
        )  # hypothetical
        second = self._evaluate(call, spec, approval, prepared)
        denial = self._denial(second, call, spec, approvals_lift=False)
        if denial is not None:
            return denial
        gate_ids = [g.policy_id for g in gates]
        if granted:
            return self._allow(second, gate_ids, required)
        return Decision(
            allowed=False,
            policy_version=self.version,
            policy_ids=gate_ids,
            status="denied",
            requires_approval=True,
            required_approvals=required,
            approval_reason="; ".join(g.reason for g in gates if g.has_reason),
            error=ToolError(
                code=ErrorCode.APPROVAL_REQUIRED,
                retryable=False,
                message=(
                    f"{spec.name} needs {required} distinct approver(s), has {len(distinct)}: "
                    + ("; ".join(g.reason for g in gates) or "the registry requires approval")
                ),
            ),
        )

    def _prepare(
        self, call: ToolCall, spec: ToolSpec, resources: Sequence[ResourceSeen] | None
    ) -> Prepared:
        refs = resource_refs(call, spec) if spec.resources else []
        known = known_resources(refs, resources)
        delta = call_entities(call, spec, self.bundle.settings.roles, self._tasks)
        providers = self.bundle.settings.entities
        for seen in known:
            provider = providers.get(seen.type)
            delta.append(resource_entity(seen, provider.references if provider else {}))
        entities = self._entities(self._tool_base(spec), _json.encode(delta).decode())
        targets = [uid(t, i) for t, i in refs]
        target = task_target(call, spec)
        if target is not None:
            targets.insert(0, uid("Task", target))
        now = self._clock()
        extra: dict[str, Any] = {}
        kind = session_kind_of(call)  # checked whether or not the schema declares it
        if self.features.session_kind:
            extra["session_kind"] = kind
        if self.features.local_time:
            extra["local_time"] = local_time(
                now, self.bundle.settings.zone_of(call.principal.tenant)
            )
        context = request_for(call, spec, NO_APPROVAL, int(now), extra_context=extra)["context"]
        return Prepared(
            entities=entities, targets=targets or [uid("Tool", spec.name)], context=context
        )

    def _evaluate(
        self, call: ToolCall, spec: ToolSpec, approval: ApprovalState, prepared: Prepared
    ) -> list[tuple[dict[str, str], cedarpy.AuthzResult]]:
        """One evaluation per resource of the call."""
        # Encoded here with msgspec: cedarpy would json.dumps the context itself, slower.
        context = _json.encode({**prepared.context, "approval": approval.as_context()}).decode()
        principal = uid("User", call.principal.user)
        action = uid("Action", spec.action_class)
        return [
            (
                target,
                cedarpy.is_authorized(
                    {
                        "principal": principal,
                        "action": action,
                        "resource": target,
                        "context": context,
                    },
                    self.bundle.policy_set,
                    prepared.entities,
                ),
            )
            for target in prepared.targets
        ]

    def _tool_base(self, spec: ToolSpec) -> cedarpy.Entities:
        cached = self._tool_entities.get(spec.name)
        if cached is not None and cached[0] is spec:
            return cached[1]
        base = cedarpy.Entities.from_json_str(
            _json.encode(action_entities() + [tool_entity(spec)]).decode()
        )
        self._tool_entities[spec.name] = (spec, base)
        return base

    def _entities(self, base: cedarpy.Entities, delta: str) -> cedarpy.Entities:
        """`base` plus the entities of `delta` (a JSON list), parsed once per delta."""
        found = self._call_entities.get(delta)
        if found is not None and found[0] is base:
            return found[1]
        entities = base.with_added_json_str(delta)
        if len(self._call_entities) >= CALL_ENTITIES_KEPT:
            del self._call_entities[next(iter(self._call_entities))]  # the oldest first
        self._call_entities[delta] = (base, entities)
        return entities

    def _policies(self, ids: Sequence[str]) -> list[PolicyInfo]:
        return sorted((self.bundle.policies[i] for i in ids), key=lambda p: p.order)

    def _denial(
        self,
        results: list[tuple[dict[str, str], cedarpy.AuthzResult]],
        call: ToolCall,
        spec: ToolSpec,
        approvals_lift: bool,
    ) -> Decision | None:
        """The deny these results mean, or None (all allowed, or gated only by approval)."""
        for target, result in results:
            forbids = [] if result.allowed else self._policies(result.diagnostics.reasons)
            hard = [p for p in forbids if not (approvals_lift and p.approvers)]
            if hard:
                first = hard[0]
                return self._deny(
                    first.error_code,
                    f"{first.reason} (policy {first.policy_id!r}; {describe(call, spec, target)})",
                    [p.policy_id for p in hard],
                )
        errors = [e for _, result in results for e in result.diagnostics.errors]
        if errors:
            return self._deny(
                ErrorCode.POLICY_ERROR, "policy evaluation failed: " + "; ".join(errors), []
            )
        for target, result in results:
            if not result.allowed and not result.diagnostics.reasons:
                return self._deny(
                    ErrorCode.POLICY_DENIED,
                    f"no policy permits this call ({describe(call, spec, target)})",
                    [],
                )
        return None

    def _allow(
        self,
        results: list[tuple[dict[str, str], cedarpy.AuthzResult]],
        gate_ids: Sequence[str] = (),
        required: int = 0,
    ) -> Decision:
        permits = [
            p.policy_id
            for p in self._policies(
                list(
                    dict.fromkeys(
                        reason for _, result in results for reason in result.diagnostics.reasons
                    )
                )
            )
        ]
        return Decision(
            allowed=True,
            policy_version=self.version,
            status="ok",
            policy_ids=[*gate_ids, *permits],
            requires_approval=required > 0,
            required_approvals=required,
        )

    def _deny(
        self, code: str, message: str, policy_ids: list[str], retryable: bool = False
    ) -> Decision:
        return Decision(
            allowed=False,
            policy_version=self.version,
            policy_ids=policy_ids,
            status="denied",
            error=ToolError(code=code, message=message[:MAX_MESSAGE_CHARS], retryable=retryable),
        )


def describe(call: ToolCall, spec: ToolSpec, resource: Mapping[str, str] | None = None) -> str:
    principal = call.principal
    target = task_target(call, spec)
    named = (
        ""
        if resource is None or resource["type"] in ("Task", "Tool")
        else f", resource {resource['type']} {resource['id']!r}"
    )
    return (
        f"tenant {principal.tenant!r}, user {principal.user!r}, agent {principal.agent!r}, "
        f"tool {spec.name!r}, call's task {call.task_id!r}"
        + ("" if target is None else f", task written {target!r}")
        + named
    )


def _declares(bundle: PolicyBundle, condition: str) -> bool:
    """Whether a policy with this condition validates against the bundle's schema."""
    probe = f'@id("probe") permit (principal, action, resource) when {{ {condition} }};'
    return bool(cedarpy.validate_policies(probe, bundle.schema).validation_passed)


def schema_features(bundle: PolicyBundle) -> SchemaFeatures:
    return SchemaFeatures(
        session_kind=_declares(bundle, 'context.session_kind == ""'),
        local_time=_declares(
            bundle,
            "context.local_time.hour == 0 && "
            "context.local_time.minute == 0 && "
            'context.local_time.weekday == "" && '
            'context.local_time.time_zone == ""',
        ),
        actions=tuple(a for a in FINER_ACTIONS if _declares(bundle, f'action == Action::"{a}"')),
    )


def check_engine_fits_schema(bundle: PolicyBundle) -> SchemaFeatures:
    """Refuse a schema that does not describe the requests this engine sends.

    Requests are evaluated without the schema (so undeclared arguments may be
    passed); this checks once, at load, that everything else conforms, and
    returns the optional parts the schema declares (SchemaFeatures).
    """
    features = schema_features(bundle)
    sample = ToolSpec.model_construct(
        name="schema_probe",
        risk="low",
        read_only=False,
        requires_approval=False,
        allowed_agents=["*", "probe"],
        task_scope="task_id",
    )
    call = ToolCall(
        call_id="probe",
        tool=sample.name,
        arguments={},
        task_id="t",
        principal=Principal(tenant="probe", user="probe", agent="probe", session="probe"),
    )
    extra: dict[str, Any] = {}
    if features.session_kind:
        extra["session_kind"] = "interactive"
    if features.local_time:
        extra["local_time"] = local_time(0, bundle.settings.zone_of("probe"))
    for read_only in (False, True):
        spec = sample.model_copy(update={"read_only": read_only})
        entities = (
            action_entities(features.actions) + [tool_entity(spec)] + call_entities(call, spec, {})
        )
        result = cedarpy.is_authorized(
            request_for(call, spec, NO_APPROVAL, 0, extra_context=extra),
            bundle.policy_set,
            entities,
            schema=bundle.schema,
        )
        misfits = [
            e
            for e in result.diagnostics.errors
            if not e.startswith("error while evaluating policy")
        ]
        if misfits:
            raise BundleError(
                f"{SCHEMA_FILE}: does not describe what the engine sends: " + "; ".join(misfits)
            )
    return features


def engine_from_files(files: Mapping[str, str], tasks: TaskTenants | None = None) -> CedarEngine:
    """Build and check an engine from bundle files: what push, check and reload all use."""
    return CedarEngine(build_bundle(files), tasks=tasks)
