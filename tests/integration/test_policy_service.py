"""The policy service against a real nats-server: hot reload, signed bundles, fail-closed
state, shared rate limits, approvals.

Each test runs policy replicas in-process (`build_app` + `async with app`),
publishes events onto the real events stream as the validator or the
approvals service would, and reads what the replicas decided from it.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import msgspec
import nats
import pytest
import yaml
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from tests.harness import events_of, publish_event, read_events
from toolgate.contracts.authorization import arguments_sha256, load_public_key, verify
from toolgate.contracts.calls import Principal, ToolCall
from toolgate.contracts.events import (
    ApprovalGranted,
    ApprovalRequested,
    ArgumentsValidated,
    CallAuthorized,
    CallDenied,
    Event,
    call_fields,
    derive_event_id,
    utc_now,
)
from toolgate.contracts.registry import BUILTIN_TOOLS_DIR, RateLimit
from toolgate.runtime.settings import GatewaySettings
from toolgate.runtime.topology import apply_topology
from toolgate.services.policy.app import PolicyStateError, build_app
from toolgate.services.policy.bundle import (
    DEFAULT_BUNDLE_DIR,
    bundle_version,
    read_bundle_dir,
)
from toolgate.services.policy.bundle_store import (
    ACTIVE_KEY,
    open_bucket,
    policies_bucket_config,
    push_bundle,
)
from toolgate.services.policy.pushing import push_next_version, read_state
from toolgate.services.policy.rate_limits import RateLimiter, rate_limits_bucket_config
from toolgate.services.policy.signing import StoredBundle, ensure_signing_key, sign_bundle
from toolgate.stack.nats_server import EmbeddedNats

ALICE = Principal(tenant="acme", user="u-alice", agent="researcher", session="s-1")
DEFAULT_VERSION = bundle_version(read_bundle_dir(DEFAULT_BUNDLE_DIR))
NO_ECHO = (
    '@id("no-echo") @error_code("TOOL_NOT_ALLOWED")\n'
    'forbid (principal, action, resource == Tool::"echo");\n'
)
NOOP = '@id("noop") forbid (principal, action, resource == Tool::"nothing");\n'
DECIDED = (CallAuthorized, CallDenied, ApprovalRequested)


@pytest.fixture
async def url(nats_server: EmbeddedNats) -> str:
    await apply_topology(nats_server.url)
    return nats_server.url


@pytest.fixture
def settings(url: str, tmp_path: Path) -> GatewaySettings:
    """The built-in tools plus a critical echo and a rate-limited echo."""
    registry = tmp_path / "registry"
    registry.mkdir()
    for source in BUILTIN_TOOLS_DIR.glob("*.yaml"):
        shutil.copy(source, registry / source.name)
    echo = yaml.safe_load((BUILTIN_TOOLS_DIR / "echo.yaml").read_text())
    extra_tools: dict[str, dict[str, Any]] = {
        "critical_echo": {"risk": "critical"},
        "limited_echo": {"rate_limit": {"calls": 3, "per_seconds": 3600}},
    }
    for name, changes in extra_tools.items():
        (registry / f"{name}.yaml").write_text(yaml.safe_dump({**echo, "name": name, **changes}))
    return GatewaySettings(
        nats_url=url, data_dir=tmp_path / "data", registry_dirs=(registry,), builtin_tools=False
    )


@asynccontextmanager
async def replica(settings: GatewaySettings) -> AsyncIterator[None]:
    async with build_app(settings):
        yield


def bundle_files(**extra: str) -> dict[str, str]:
    return {**read_bundle_dir(DEFAULT_BUNDLE_DIR), **extra}


async def push_files(settings: GatewaySettings, files: dict[str, str]) -> StoredBundle:
    """What `toolgate policy push` does: sign as the next version with the operator's
    key, store."""
    key, _ = ensure_signing_key(settings.keys_dir)
    nc = await nats.connect(settings.nats_url)
    try:
        _, bundle = await push_next_version(
            await read_state(nc.jetstream()), files, "pushed from test", key
        )
    finally:
        await nc.close()
    return bundle


def validated(call: ToolCall) -> ArgumentsValidated:
    return ArgumentsValidated(
        event_id=derive_event_id(f"test:{call.call_id}", "validated"),
        occurred_at=utc_now(),
        service="validator",
        call=call,
        arguments_sha256=arguments_sha256(call.arguments),
        **call_fields(call),
    )


def granted(
    call: ToolCall, approvers: list[str], quorum: bool, sha: str | None = None
) -> ApprovalGranted:
    return ApprovalGranted(
        event_id=derive_event_id(f"test:{call.call_id}", f"granted/{approvers[-1]}"),
        occurred_at=utc_now(),
        service="approvals",
        call=call,
        policy_version=DEFAULT_VERSION,
        approver=approvers[-1],
        approvers=approvers,
        required_approvals=2,
        quorum_reached=quorum,
        arguments_sha256=sha or arguments_sha256(call.arguments),
        **call_fields(call),
    )


def echo_call(call_id: str, tool: str = "echo") -> ToolCall:
    return ToolCall(
        call_id=call_id,
        tool=tool,
        arguments={"payload": call_id},
        principal=ALICE,
        task_id="task_c04",
    )


async def decisions(url: str, call_id: str, count: int = 1, timeout: float = 15.0) -> list[Event]:
    """The policy's outcome events for `call_id`, once `count` of them exist."""
    for _ in range(int(timeout / 0.05)):
        found = [e for e in events_of(await read_events(url), call_id) if isinstance(e, DECIDED)]
        if len(found) >= count:
            return found
        await asyncio.sleep(0.05)
    raise TimeoutError(f"no policy decision for {call_id} within {timeout}s")


async def decide(url: str, call: ToolCall) -> Event:
    await publish_event(url, validated(call))
    return (await decisions(url, call.call_id))[0]


async def first_decision_under(url: str, version: str, prefix: str) -> Event:
    """Echo calls until one is decided under `version` (a push lands within a moment)."""
    for attempt in range(100):
        decided = await decide(url, echo_call(f"{prefix}-{attempt}"))
        if decided.policy_version == version:
            return decided
    raise TimeoutError(f"bundle {version} never became active")


class TestHotReload:
    async def test_pushed_bundle_switches_a_running_replica(
        self, url: str, settings: GatewaySettings
    ) -> None:
        strict = bundle_files(**{"no-echo.cedar": NO_ECHO})
        async with replica(settings):
            before = await decide(url, echo_call("before"))
            assert isinstance(before, CallAuthorized) and before.policy_version == DEFAULT_VERSION
            await push_files(settings, strict)
            after = await first_decision_under(url, bundle_version(strict), "after")
            assert isinstance(after, CallDenied) and after.policy_ids == ["no-echo"]
            assert after.error.code == "TOOL_NOT_ALLOWED"

    async def test_bad_pushed_bundle_is_ignored_and_later_pushes_still_apply(
        self, url: str, settings: GatewaySettings
    ) -> None:
        strict = bundle_files(**{"no-echo.cedar": NO_ECHO})
        await push_files(settings, strict)
        async with replica(settings):
            # Straight into the bucket, past the validation `toolgate policy push` does.
            nc = await nats.connect(url)
            kv = await open_bucket(nc.jetstream(), policies_bucket_config())
            key, _ = ensure_signing_key(settings.keys_dir)
            bad = bundle_files(**{"bad.cedar": "permit (principal"})
            await push_bundle(kv, sign_bundle(bad, "bad", key))
            await nc.close()
            still = await decide(url, echo_call("after-bad"))
            assert still.policy_version == bundle_version(strict)
            await push_files(settings, bundle_files())
            again = await first_decision_under(url, DEFAULT_VERSION, "again")
            assert isinstance(again, CallAuthorized)

    async def test_replica_started_after_a_push_decides_under_it_from_the_first_call(
        self, url: str, settings: GatewaySettings
    ) -> None:
        strict = bundle_files(**{"no-echo.cedar": NO_ECHO})
        await push_files(settings, strict)
        async with replica(settings):
            first = await decide(url, echo_call("first"))
        assert isinstance(first, CallDenied) and first.policy_version == bundle_version(strict)


class TestRateLimit:
    async def test_limit_holds_across_replicas(self, url: str, settings: GatewaySettings) -> None:
        # limited_echo allows 3 calls an hour per user: the count lives in JetStream,
        # so a replica that starts later, or runs beside another, continues it.
        calls = [echo_call(f"limited-{i}", tool="limited_echo") for i in range(8)]

        async def outcomes(batch: list[ToolCall]) -> list[Event]:
            await asyncio.gather(*(publish_event(url, validated(c)) for c in batch))
            return [(await decisions(url, c.call_id))[0] for c in batch]

        async with replica(settings):
            first = await outcomes(calls[:2])
        async with replica(settings):
            second = await outcomes(calls[2:4])
        async with replica(settings), replica(settings):
            both = await outcomes(calls[4:])
        assert [type(e) for e in first] == [CallAuthorized, CallAuthorized]
        assert sorted(type(e).__name__ for e in second) == ["CallAuthorized", "CallDenied"]
        limited = [e for e in [*second, *both] if isinstance(e, CallDenied)]
        assert len(limited) == 5 and len(both) == 4 and all(e in limited for e in both)
        assert all(e.error.code == "RATE_LIMITED" and e.error.retryable for e in limited)

    async def test_racing_limiters_admit_exactly_the_limit_and_a_call_once(self, url: str) -> None:
        connections = [await nats.connect(url) for _ in range(2)]
        limiters = [
            RateLimiter(
                await open_bucket(nc.jetstream(), rate_limits_bucket_config()), clock=lambda: 1000.0
            )
            for nc in connections
        ]
        limit = RateLimit(calls=5, per_seconds=60)
        calls = [echo_call(f"race-{i}") for i in range(20)]
        checks = await asyncio.gather(
            *(limiters[i % 2].admit(c, limit) for i, c in enumerate(calls))
        )
        again = await limiters[1].admit(
            next(c for c, ok in zip(calls, checks, strict=True) if ok.admitted), limit
        )
        for nc in connections:
            await nc.close()
        assert sum(check.admitted for check in checks) == 5
        assert again.admitted and again.count == 5  # a redelivery is not counted twice


class TestApproval:
    async def test_critical_call_waits_for_quorum_then_is_authorized_with_its_approvers(
        self, url: str, settings: GatewaySettings
    ) -> None:
        call = echo_call("crit", tool="critical_echo")
        async with replica(settings):
            requested = await decide(url, call)
            assert isinstance(requested, ApprovalRequested)
            assert requested.required_approvals == 2 and requested.risk == "critical"
            assert requested.policy_version == DEFAULT_VERSION
            assert 890 <= (requested.expires_at - requested.occurred_at).total_seconds() <= 900
            await publish_event(url, granted(call, ["ann"], quorum=False))
            await publish_event(url, granted(call, ["ann", "bob"], quorum=True))
            authorized = (await decisions(url, call.call_id, count=2))[1]
        assert isinstance(authorized, CallAuthorized)
        assert authorized.authorization.approvals == ["ann", "bob"]
        assert verify(authorized.authorization, load_public_key(settings.keys_dir))
        assert "approval-critical" in authorized.policy_ids

    async def test_approval_for_other_arguments_is_refused(
        self, url: str, settings: GatewaySettings
    ) -> None:
        call = echo_call("swapped", tool="critical_echo")
        tampered = msgspec.structs.replace(call, arguments={"payload": "rm -rf /"})
        async with replica(settings):
            await decide(url, call)
            await publish_event(
                url,
                granted(
                    tampered, ["ann", "bob"], quorum=True, sha=arguments_sha256(call.arguments)
                ),
            )
            refused = (await decisions(url, call.call_id, count=2))[1]
        assert isinstance(refused, CallDenied) and "other arguments" in refused.error.message

    async def test_granted_call_is_decided_again_under_the_bundle_active_now(
        self, url: str, settings: GatewaySettings
    ) -> None:
        call = echo_call("changed", tool="critical_echo")
        no_critical = bundle_files(
            **{
                "no-critical.cedar": (
                    '@id("no-critical-echo") forbid (principal, action, '
                    'resource == Tool::"critical_echo");\n'
                )
            }
        )
        async with replica(settings):
            await decide(url, call)
            await push_files(settings, no_critical)
            await first_decision_under(url, bundle_version(no_critical), "probe")
            await publish_event(url, granted(call, ["ann", "bob"], quorum=True))
            denied = (await decisions(url, call.call_id, count=2))[1]
        assert isinstance(denied, CallDenied) and denied.policy_ids == ["no-critical-echo"]
        assert denied.policy_version == bundle_version(no_critical)


async def put_raw(url: str, value: bytes) -> None:
    """Straight into the bucket, as anyone with write access could, past `policy push`."""
    nc = await nats.connect(url)
    try:
        kv = await open_bucket(nc.jetstream(), policies_bucket_config())
        await kv.put(ACTIVE_KEY, value)
    finally:
        await nc.close()


def refusals(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "toolgate.policy" and r.levelno >= logging.ERROR
    ]


class TestPolicyState:
    """The policy state fails closed: never a silent fall-back to the default bundle."""

    async def test_garbled_bundle_at_restart_keeps_the_last_bundle_the_service_accepted(
        self, url: str, settings: GatewaySettings, caplog: pytest.LogCaptureFixture
    ) -> None:
        strict = bundle_files(**{"no-echo.cedar": NO_ECHO})
        await push_files(settings, strict)
        async with replica(settings):
            before = await decide(url, echo_call("before-garble"))
        assert isinstance(before, CallDenied) and before.policy_ids == ["no-echo"]
        await put_raw(url, b'{"files": {"schema.cedarschema": "entity Us')
        async with replica(settings):
            after = await decide(url, echo_call("after-garble"))
        assert isinstance(after, CallDenied) and after.policy_version == bundle_version(strict)
        [line] = refusals(caplog)
        assert "not readable" in line and "keeping version 1" in line

    async def test_garbled_bundle_with_none_accepted_refuses_to_start_and_decides_nothing(
        self, url: str, settings: GatewaySettings, caplog: pytest.LogCaptureFixture
    ) -> None:
        strict = bundle_files(**{"no-echo.cedar": NO_ECHO})
        await push_files(settings, strict)
        await put_raw(url, b'{"files": {"schema.cedarschema": "entity Us')
        with pytest.raises(PolicyStateError) as raised:
            async with replica(settings):
                pass
        assert "not readable" in raised.value.reason
        assert refusals(caplog) == [raised.value.reason]
        # A call that arrives meanwhile waits: the next replica to start, under a
        # good bundle pushed later, decides it. Nothing decided it under the default.
        waiting = echo_call("while-refused")
        await publish_event(url, validated(waiting))
        later = bundle_files(**{"no-echo.cedar": NO_ECHO, "later.cedar": NOOP})
        await push_files(settings, later)
        async with replica(settings):
            [decided] = await decisions(url, waiting.call_id)
        assert isinstance(decided, CallDenied)
        assert decided.policy_version == bundle_version(later)

    @pytest.mark.parametrize("how", ["unsigned", "another key", "valid signature, bad bundle"])
    async def test_a_bundle_not_pushed_by_the_operator_refuses_to_start(
        self, url: str, settings: GatewaySettings, how: str
    ) -> None:
        operator, _ = ensure_signing_key(settings.keys_dir)
        default = bundle_files()
        value = {
            "unsigned": msgspec.json.encode(StoredBundle(files=default)),
            "another key": msgspec.json.encode(
                sign_bundle(default, DEFAULT_VERSION, Ed25519PrivateKey.generate())
            ),
            "valid signature, bad bundle": msgspec.json.encode(
                sign_bundle(bundle_files(**{"bad.cedar": "permit (principal"}), "x", operator)
            ),
        }[how]
        await put_raw(url, value)
        with pytest.raises(PolicyStateError) as raised:
            async with replica(settings):
                pass
        assert {
            "unsigned": "not signed",
            "another key": "not by the trusted key",
            "valid signature, bad bundle": "bad.cedar:1",
        }[how] in raised.value.reason

    async def test_running_replica_keeps_its_last_good_bundle_through_bad_writes(
        self, url: str, settings: GatewaySettings, caplog: pytest.LogCaptureFixture
    ) -> None:
        strict = bundle_files(**{"no-echo.cedar": NO_ECHO})
        await push_files(settings, strict)
        default = bundle_files()
        async with replica(settings):
            assert (await decide(url, echo_call("good"))).policy_version == bundle_version(strict)
            # The attack of the issue: the approval-free default, without the operator.
            await put_raw(url, msgspec.json.encode(StoredBundle(files=default)))
            await put_raw(
                url,
                msgspec.json.encode(
                    sign_bundle(default, DEFAULT_VERSION, Ed25519PrivateKey.generate())
                ),
            )
            await put_raw(url, b"\x00garbage")
            # A good push after them: once it is active, the bad writes were judged.
            later = bundle_files(**{"no-echo.cedar": NO_ECHO, "later.cedar": NOOP})
            await push_files(settings, later)
            switched = await first_decision_under(url, bundle_version(later), "probe")
        assert isinstance(switched, CallDenied)
        probes = [e for e in await read_events(url) if isinstance(e, DECIDED)]
        assert DEFAULT_VERSION not in {e.policy_version for e in probes}
        lines = refusals(caplog)
        assert len(lines) == 3, lines
        assert all(f"bundle {bundle_version(strict)}" in line for line in lines)
        assert all("keeping version 1 (pushed from test" in line for line in lines)
        assert "not signed" in lines[0] and "not by the trusted key" in lines[1]
        assert "not readable" in lines[2]


async def policy_kv(url: str) -> tuple[Any, Any]:
    """A connection and the policies bucket, as anyone with write access to it has them."""
    nc = await nats.connect(url)
    return nc, await open_bucket(nc.jetstream(), policies_bucket_config())


async def until_refused(
    url: str, caplog: pytest.LogCaptureFixture, count: int, prefix: str
) -> None:
    """Decide calls until the replica has logged `count` refusals (it judged the writes)."""
    for attempt in range(200):
        if len(refusals(caplog)) >= count:
            return
        await decide(url, echo_call(f"{prefix}-{attempt}"))
    raise AssertionError(f"fewer than {count} refusals: {refusals(caplog)}")


class TestVersionsOnlyMoveForward:
    """Invariant 12 against a real bucket: whoever writes it, nothing older becomes active."""

    async def test_an_older_signed_bundle_from_history_or_a_delete_changes_nothing(
        self, url: str, settings: GatewaySettings, caplog: pytest.LogCaptureFixture
    ) -> None:
        strict = bundle_files(**{"no-echo.cedar": NO_ECHO})
        await push_files(settings, bundle_files())  # version 1: echo allowed
        await push_files(settings, strict)  # version 2: echo denied
        async with replica(settings):
            assert isinstance(await decide(url, echo_call("v2")), CallDenied)
            nc, kv = await policy_kv(url)
            [first, *_] = await kv.history(ACTIVE_KEY)
            await kv.put(ACTIVE_KEY, first.value)  # version 1, validly signed, put back
            await until_refused(url, caplog, 1, "after-put-back")
            await kv.delete(ACTIVE_KEY)
            await until_refused(url, caplog, 2, "after-delete")
            await nc.close()
            still = await decide(url, echo_call("still"))
        assert isinstance(still, CallDenied) and still.policy_version == bundle_version(strict)
        older, deleted = refusals(caplog)
        assert "keeping version 2 (pushed from test" in older
        assert "version 1: its version 1 is not higher than the active version 2" in older
        assert "deleted" in deleted and "keeping version 2" in deleted

    async def test_an_equal_version_is_refused(
        self, url: str, settings: GatewaySettings, caplog: pytest.LogCaptureFixture
    ) -> None:
        strict = bundle_files(**{"no-echo.cedar": NO_ECHO})
        active = await push_files(settings, strict)
        key, _ = ensure_signing_key(settings.keys_dir)
        async with replica(settings):
            assert isinstance(await decide(url, echo_call("before")), CallDenied)
            # Signed by the operator's key, but numbered as the active one (a racing push).
            same_number = sign_bundle(
                bundle_files(), DEFAULT_VERSION, key, number=active.number, source="raced"
            )
            await put_raw(url, msgspec.json.encode(same_number))
            await until_refused(url, caplog, 1, "equal")
            after = await decide(url, echo_call("after"))
        assert isinstance(after, CallDenied) and after.policy_version == bundle_version(strict)
        [line] = refusals(caplog)
        assert "its version 1 is not higher than the active version 1" in line

    async def test_a_bucket_rewritten_while_no_replica_runs_does_not_win(
        self, url: str, settings: GatewaySettings, caplog: pytest.LogCaptureFixture
    ) -> None:
        strict = bundle_files(**{"no-echo.cedar": NO_ECHO})
        await push_files(settings, bundle_files())
        await push_files(settings, strict)
        async with replica(settings):  # accepts version 2 and records it
            assert isinstance(await decide(url, echo_call("v2")), CallDenied)
        # While no replica runs: version 1 put back over a purge (which also drops the
        # bucket's history, so nothing there says version 2 ever existed).
        nc, kv = await policy_kv(url)
        [first, *_] = await kv.history(ACTIVE_KEY)
        await kv.purge(ACTIVE_KEY)
        await kv.put(ACTIVE_KEY, first.value)
        await nc.close()
        async with replica(settings):
            restarted = await decide(url, echo_call("restarted"))
        assert isinstance(restarted, CallDenied)
        assert restarted.policy_version == bundle_version(strict)
        [line] = refusals(caplog)
        assert "keeping version 2" in line and "not higher than the active version 2" in line
        # A push now is numbered above the record, not above what the bucket shows.
        later = await push_files(settings, bundle_files())
        assert later.number == 3
        async with replica(settings):
            assert isinstance(await decide(url, echo_call("v3")), CallAuthorized)
