"""`toolgate policy push` on the locked bus `toolgate up` runs, and the policy service's
fail-closed state, each service its own process (tests/harness.py Gateway).

The CLI runs as an operator would: in the folder `toolgate up` ran in, with no
flags and no TOOLGATE_* variables: URL, admin creds and the signing key come
from what `toolgate up` recorded there.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from nats.js.errors import KeyWrongLastSequenceError

from tests.harness import Gateway, make_test_registry
from toolgate.client.gateway_client import GatewayClient
from toolgate.contracts.calls import ToolResult
from toolgate.services.policy.bundle import DEFAULT_BUNDLE_DIR, bundle_version, read_bundle_dir
from toolgate.services.policy.bundle_store import ACTIVE_KEY, POLICIES_BUCKET
from toolgate.services.policy.pushing import push_next_version, read_state
from toolgate.services.policy.signing import PRIVATE_KEY_FILE, StoredBundle, ensure_signing_key
from toolgate.stack.nats_server import free_port

pytestmark = pytest.mark.slow  # a whole gateway (`toolgate up`) per test

NO_ECHO = (
    '@id("no-echo") @error_code("TOOL_NOT_ALLOWED")\n'
    'forbid (principal, action, resource == Tool::"echo");\n'
)
NO_SEARCH = (
    '@id("no-search") @error_code("TOOL_NOT_ALLOWED")\n'
    'forbid (principal, action, resource == Tool::"search_sources");\n'
)


@pytest.fixture
def up(tmp_path: Path) -> Iterator[Gateway]:
    """`toolgate up` in the folder tmp_path: its data in tmp_path/.toolgate."""
    gateway = Gateway(
        data_dir=tmp_path / ".toolgate", registry_dir=make_test_registry(tmp_path / "registry")
    ).start()
    yield gateway
    gateway.stop()


def bundle_dir(where: Path, **extra: str) -> Path:
    where.mkdir()
    for name, text in {**read_bundle_dir(DEFAULT_BUNDLE_DIR), **extra}.items():
        (where / name).write_text(text)
    return where


def toolgate(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOOLGATE_")}
    return subprocess.run(
        [sys.executable, "-m", "toolgate.cli.main", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


async def echo(client: GatewayClient) -> ToolResult:
    return await client.call("echo", {"payload": "hi"}, user="u-alice", session="s-1")


async def until_echo_is(client: GatewayClient, ok: bool) -> None:
    """Echo calls until one is decided as `ok` says (a push lands within a moment)."""
    for _ in range(200):
        result = await echo(client)
        if result.ok == ok:
            return
    raise AssertionError(f"echo never became {'allowed' if ok else 'denied'}")


def policy_log_since(gateway: Gateway, offset: int) -> str:
    return gateway.service("policy").log_path.read_bytes()[offset:].decode()


def one_line(result: subprocess.CompletedProcess[str]) -> str:
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


async def test_push_signs_and_takes_effect_and_a_bundle_put_by_anyone_else_is_refused(
    up: Gateway, tmp_path: Path
) -> None:
    strict = bundle_dir(tmp_path / "strict", **{"no-echo.cedar": NO_ECHO})
    pushed = toolgate(tmp_path, "policy", "push", str(strict))
    assert pushed.returncode == 0, pushed.stderr
    version = bundle_version(read_bundle_dir(strict))
    assert f"pushed policy bundle {version}" in pushed.stdout
    assert "created the policy-signing key" in pushed.stderr  # first push: no key yet
    key = up.data_dir / "keys" / PRIVATE_KEY_FILE
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    client = await up.client()
    async with client:
        await until_echo_is(client, ok=False)
        denied = await echo(client)
        assert denied.status == "denied" and denied.error is not None
        assert denied.error.code == "TOOL_NOT_ALLOWED"

        # The attack: the default bundle, valid but unsigned, put straight in.
        log_offset = up.service("policy").log_path.stat().st_size
        nc = await up.connect("admin")
        kv = await nc.jetstream().key_value(POLICIES_BUCKET)
        await kv.put(
            ACTIVE_KEY, msgspec.json.encode(StoredBundle(files=read_bundle_dir(DEFAULT_BUNDLE_DIR)))
        )
        await nc.close()
        for _ in range(600):  # the running service says so, once, and keeps its bundle
            if " ERROR " in policy_log_since(up, log_offset):
                break
            await client.result("none-such")  # a round trip, instead of a sleep
        [refused] = [
            line for line in policy_log_since(up, log_offset).splitlines() if " ERROR " in line
        ]
        assert "not signed" in refused and "keeping version 1 (" in refused
        assert f"bundle {version}" in refused
        assert (await echo(client)).status == "denied"

        # Restarted now, it starts under the last bundle it accepted (its own record,
        # which no bucket writer can change), saying once why not the stored one.
        policy = up.service("policy")
        policy.stop()
        log_offset = policy.log_path.stat().st_size
        policy.start()
        assert (await echo(client)).status == "denied"
        log = policy_log_since(up, log_offset)
        assert "Traceback" not in log
        [line] = [line for line in log.splitlines() if " ERROR " in line]
        assert "not signed" in line and "keeping version 1 (pushed from " in line

        # A properly pushed bundle replaces it.
        no_search = bundle_dir(tmp_path / "no-search", **{"no-search.cedar": NO_SEARCH})
        again = toolgate(tmp_path, "policy", "push", str(no_search))
        assert again.returncode == 0 and "created" not in again.stderr, again.stderr
        assert "as version 2 " in again.stdout
        await until_echo_is(client, ok=True)
        search = await client.call(
            "search_sources",
            {"query": "agents", "source_type": "any", "limit": 3},
            user="u-alice",
            session="s-1",
        )
        assert search.error is not None and search.error.code == "TOOL_NOT_ALLOWED"
        assert policy.alive()


async def test_a_push_that_raced_another_writes_nothing(up: Gateway, tmp_path: Path) -> None:
    strict = bundle_dir(tmp_path / "strict", **{"no-echo.cedar": NO_ECHO})
    assert toolgate(tmp_path, "policy", "push", str(strict)).returncode == 0
    key, _ = ensure_signing_key(up.data_dir / "keys")
    nc = await up.connect("admin")
    try:
        stale = await read_state(nc.jetstream())  # read, then another push lands
        assert toolgate(tmp_path, "policy", "push", str(strict)).returncode == 0
        with pytest.raises(KeyWrongLastSequenceError):
            await push_next_version(stale, read_bundle_dir(strict), "late", key)
        state = await read_state(nc.jetstream())
    finally:
        await nc.close()
    assert [
        msgspec.json.decode(e.value or b"", type=StoredBundle).number for e in state.written
    ] == [1, 2]


def test_check_from_a_folder_without_a_gateway_says_what_it_could_not_check(
    tmp_path: Path,
) -> None:
    """Run from another folder, `policy check` took the built-in tools and passed a
    misspelt argument of the operator's own tool in silence (exit 0, no word)."""
    typo = (
        '@id("tickets")\n'
        'forbid (principal, action, resource == Tool::"create_ticket")\n'
        'when { context.arguments has priorty && context.arguments.priorty == "high" };\n'
    )
    mine = bundle_dir(tmp_path / "mine", **{"tickets.cedar": typo})
    result = toolgate(tmp_path, "policy", "check", str(mine))
    assert result.returncode == 0, result.stderr
    line = one_line(result)
    assert "policy 'tickets' reads arguments of no tool in the built-in tools" in line
    assert "not checked" in line and "--data-dir or --registry" in line


def test_push_that_cannot_reach_the_bus_says_so_in_one_line(tmp_path: Path) -> None:
    strict = bundle_dir(tmp_path / "strict", **{"no-echo.cedar": NO_ECHO})
    nowhere = f"nats://127.0.0.1:{free_port()}"
    result = toolgate(
        tmp_path, "policy", "push", str(strict), "--nats-url", nowhere, "--connect-timeout", "2"
    )
    assert result.returncode == 3
    assert one_line(result).startswith(f"toolgate policy push: cannot connect to NATS at {nowhere}")


async def test_push_with_creds_that_may_not_write_the_bucket_says_so_in_one_line(
    up: Gateway, tmp_path: Path
) -> None:
    strict = bundle_dir(tmp_path / "strict", **{"no-echo.cedar": NO_ECHO})
    agent = await up.agent_creds()
    missing = tmp_path / "no-such.creds"
    for creds, words in (
        (agent, "cannot read toolgate_policies"),
        (missing, "no credentials file"),
    ):
        result = toolgate(
            tmp_path, "policy", "push", str(strict), "--creds", str(creds), "--connect-timeout", "2"
        )
        assert result.returncode == 3
        assert words in one_line(result)


def test_the_data_dir_flag_says_where_the_key_is(tmp_path: Path) -> None:
    # A bad bundle is refused before anything is created or connected to.
    bad = bundle_dir(tmp_path / "bad", **{"bad.cedar": "permit (principal"})
    result = toolgate(tmp_path, "policy", "push", str(bad), "--data-dir", str(tmp_path / "d"))
    assert result.returncode == 2 and "bad.cedar:1" in result.stderr
    assert not (tmp_path / "d").exists()
    shutil.rmtree(bad)
