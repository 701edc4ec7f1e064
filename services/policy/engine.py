"""The Cedar policy engine: one loaded bundle, decisions over the six-tuple.

Parsed once: the bundle holds a parsed `cedarpy.PolicySet` (keyed by @id)
and `Schema`; each tool's entity and the action hierarchy are parsed once
into an `Entities` handle, and a call adds only its own user, agent and tasks
(`with_added_json_str` parses just that delta).

How a call is judged:
0. Every argument must fit the Cedar context (entities.py); one that does
   not (a float, an integer beyond 64 bits, a very long string, ...) denies
   the call (POLICY_DENIED, naming the argument): never dropped unseen.
1. Evaluate with no approval. A forbid that is not an approval policy, any
   evaluation error, or no permit at all: denied. Cedar skips a policy whose
   evaluation errors (a forbid too), so an error is a deny here, never an allow.
2. If only approval policies forbid, or the registry insists (requires_approval
   or risk critical: at least one approver whatever the bundle says), the call
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

import cedarpy
import msgspec

from toolgate.contracts.calls import ErrorCode, Principal, ToolCall, ToolError
from toolgate.contracts.registry import ToolSpec
from toolgate.services.policy.bundle import (
    SCHEMA_FILE,
    BundleError,
    PolicyBundle,
    PolicyInfo,
    build_bundle,
)
from toolgate.services.policy.entities import (
    NO_APPROVAL,
    ApprovalState,
    TaskTenants,
    Unrepresentable,
    action_entities,
    call_entities,
    request_for,
    task_target,
    tool_entity,
)
from toolgate.services.policy.rules import Decision

MAX_MESSAGE_CHARS = 2000
_json = msgspec.json.Encoder()


def registry_approvers(spec: ToolSpec) -> int:
    """The approvers the registry demands whatever a bundle says."""
    return 1 if spec.requires_approval or spec.risk == "critical" else 0


class CedarEngine:
    def __init__(self, bundle: PolicyBundle, tasks: TaskTenants | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.bundle = bundle
        self.version = bundle.version
        self._tasks = tasks
        self._clock = clock
        self._tool_entities: dict[str, tuple[ToolSpec, cedarpy.Entities]] = {}
        check_engine_fits_schema(bundle)

    def decide(self, call: ToolCall, spec: ToolSpec | None,
               approvers: Sequence[str] = ()) -> Decision:
        if spec is None:
            return self._deny(ErrorCode.TOOL_NOT_ALLOWED,
                              f"tool {call.tool!r} is not registered here", [])
        try:
            return self._decide(call, spec, approvers)
        except Unrepresentable as exc:  # a policy must not decide without it: deny
            return self._deny(ErrorCode.POLICY_DENIED,
                              f"{exc}, so the policy cannot evaluate this call", [])
        except Exception as exc:  # fail closed
            return self._deny(ErrorCode.POLICY_ERROR, f"policy evaluation failed: {exc!r}", [])

    def _decide(self, call: ToolCall, spec: ToolSpec, approvers: Sequence[str]) -> Decision:
        first = self._evaluate(call, spec, NO_APPROVAL)
        denial = self._denial(first, call, spec, approvals_lift=True)
        if denial is not None:
            return denial
        gates = [] if first.allowed else self._policies(first.diagnostics.reasons)
        required = max([g.approvers for g in gates] + [registry_approvers(spec)])
        if required == 0:
            return self._allow(first)
        distinct = tuple(sorted(set(approvers)))
        granted = len(distinct) >= required
        approval = (ApprovalState("granted", distinct, len(distinct)) if granted
                    else ApprovalState("granted", (), required))  # hypothetical
        second = self._evaluate(call, spec, approval)
        denial = self._denial(second, call, spec, approvals_lift=False)
        if denial is not None:
            return denial
        gate_ids = [g.policy_id for g in gates]
        if granted:
            return self._allow(second, gate_ids, required)
        return Decision(
            allowed=False, policy_version=self.version, policy_ids=gate_ids, status="denied",
            requires_approval=True, required_approvals=required,
            error=ToolError(code=ErrorCode.APPROVAL_REQUIRED, retryable=False, message=(
                f"{spec.name} needs {required} distinct approver(s), has {len(distinct)}: "
                + ("; ".join(g.reason for g in gates) or "the registry requires approval"))))

    def _evaluate(self, call: ToolCall, spec: ToolSpec,
                  approval: ApprovalState) -> cedarpy.AuthzResult:
        request = request_for(call, spec, approval, int(self._clock()))
        # Encoded here with msgspec: cedarpy would json.dumps the context itself, slower.
        request["context"] = _json.encode(request["context"]).decode()
        delta = call_entities(call, spec, self.bundle.settings.roles, self._tasks)
        entities = self._tool_base(spec).with_added_json_str(_json.encode(delta).decode())
        return cedarpy.is_authorized(request, self.bundle.policy_set, entities)

    def _tool_base(self, spec: ToolSpec) -> cedarpy.Entities:
        cached = self._tool_entities.get(spec.name)
        if cached is not None and cached[0] is spec:
            return cached[1]
        base = cedarpy.Entities.from_json_str(
            _json.encode(action_entities() + [tool_entity(spec)]).decode())
        self._tool_entities[spec.name] = (spec, base)
        return base

    def _policies(self, ids: Sequence[str]) -> list[PolicyInfo]:
        return sorted((self.bundle.policies[i] for i in ids), key=lambda p: p.order)

    def _denial(self, result: cedarpy.AuthzResult, call: ToolCall, spec: ToolSpec,
                approvals_lift: bool) -> Decision | None:
        """The deny this result means, or None (allowed, or gated only by approval)."""
        errors = result.diagnostics.errors
        forbids = [] if result.allowed else self._policies(result.diagnostics.reasons)
        hard = [p for p in forbids if not (approvals_lift and p.approvers)]
        if hard:
            first = hard[0]
            return self._deny(first.error_code, f"{first.reason} (policy {first.policy_id!r}; "
                              f"{describe(call, spec)})", [p.policy_id for p in hard])
        if errors:
            return self._deny(ErrorCode.POLICY_ERROR,
                              "policy evaluation failed: " + "; ".join(errors), [])
        if not result.allowed and not forbids:
            return self._deny(ErrorCode.POLICY_DENIED,
                              f"no policy permits this call ({describe(call, spec)})", [])
        return None

    def _allow(self, result: cedarpy.AuthzResult, gate_ids: Sequence[str] = (),
               required: int = 0) -> Decision:
        permits = [p.policy_id for p in self._policies(result.diagnostics.reasons)]
        return Decision(allowed=True, policy_version=self.version, status="ok",
                        policy_ids=[*gate_ids, *permits],
                        requires_approval=required > 0, required_approvals=required)

    def _deny(self, code: str, message: str, policy_ids: list[str]) -> Decision:
        return Decision(allowed=False, policy_version=self.version, policy_ids=policy_ids,
                        status="denied", error=ToolError(
                            code=code, message=message[:MAX_MESSAGE_CHARS], retryable=False))


def describe(call: ToolCall, spec: ToolSpec) -> str:
    principal = call.principal
    target = task_target(call, spec)
    return (f"tenant {principal.tenant!r}, user {principal.user!r}, agent {principal.agent!r}, "
            f"tool {spec.name!r}, call's task {call.task_id!r}"
            + ("" if target is None else f", task written {target!r}"))


def check_engine_fits_schema(bundle: PolicyBundle) -> None:
    """Refuse a schema that does not describe the requests this engine sends.

    Requests are evaluated without the schema (so undeclared arguments may be
    passed); this checks once, at load, that everything else conforms.
    """
    sample = ToolSpec.model_construct(
        name="schema_probe", risk="low", read_only=False, requires_approval=False,
        allowed_agents=["*", "probe"], task_scope="task_id")
    call = ToolCall(call_id="probe", tool=sample.name, arguments={}, task_id="t",
                    principal=Principal(tenant="probe", user="probe",
                                                        agent="probe", session="probe"))
    for read_only in (False, True):
        spec = sample.model_copy(update={"read_only": read_only})
        entities = action_entities() + [tool_entity(spec)] + call_entities(call, spec, {})
        result = cedarpy.is_authorized(request_for(call, spec, NO_APPROVAL, 0),
                                       bundle.policy_set, entities, schema=bundle.schema)
        misfits = [e for e in result.diagnostics.errors
                   if not e.startswith("error while evaluating policy")]
        if misfits:
            raise BundleError(f"{SCHEMA_FILE}: does not describe what the engine sends: "
                              + "; ".join(misfits))


def engine_from_files(files: Mapping[str, str], tasks: TaskTenants | None = None) -> CedarEngine:
    """Build and check an engine from bundle files: what push, check and reload all use."""
    return CedarEngine(build_bundle(files), tasks=tasks)
