"""The served registry moves only forward, and only to what the operator signed.

Pure: ServedRegistry judges stored revisions (as the KV watch hands them over)
without a bus; the bucket round trip is in tests/system/test_registry_push.py.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import yaml

from toolgate.contracts.registry import BUILTIN_TOOLS_DIR, RegistryError
from toolgate.contracts.registry_bundle import (
    listing_for,
    read_registry_dir,
    registry_from_files,
    registry_of_listing,
)
from toolgate.runtime.bundle_bucket import ActiveEntry
from toolgate.runtime.served_registry import (
    REGISTRY_BUNDLE,
    RegistryStateError,
    ServedRegistry,
)
from toolgate.runtime.settings import GatewaySettings
from toolgate.runtime.signed_bundles import StoredBundle, ensure_signing_key, sign_bundle
from toolgate.services.policy.signing import POLICY_BUNDLE

ECHO = {
    "name": "echo_pushed",
    "description": "Echo. Test only.",
    "function": "tests.tools.faulty:count_runs",
    "input_schema": {"type": "object", "properties": {"text": {"type": "string"}}},
    "output_schema": {"type": "object"},
    "read_only": True,
    "timeout_s": 5,
    "risk": "low",
    "allowed_agents": ["researcher"],
}


def files_with(*tools: dict[str, object]) -> dict[str, str]:
    return {f"{tool['name']}.yaml": yaml.safe_dump(tool) for tool in tools}


def entry(revision: int, bundle: StoredBundle | bytes | None) -> ActiveEntry:
    value = bundle if isinstance(bundle, bytes | None) else msgspec.json.encode(bundle)
    return ActiveEntry(revision=revision, value=value)


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    return tmp_path / "keys"


@pytest.fixture
def served(tmp_path: Path, keys: Path) -> ServedRegistry:
    ensure_signing_key(REGISTRY_BUNDLE, keys)
    return ServedRegistry(GatewaySettings(data_dir=tmp_path))


def signed(keys: Path, number: int, files: dict[str, str]) -> StoredBundle:
    private_key, _ = ensure_signing_key(REGISTRY_BUNDLE, keys)
    return sign_bundle(REGISTRY_BUNDLE, files, "v", private_key, number=number, source="test")


class TestServedRegistry:
    def test_serves_a_pushed_tool_beside_the_built_in_ones(
        self, served: ServedRegistry, keys: Path
    ) -> None:
        assert served.current.get("echo_pushed") is None
        assert served.offer(entry(1, signed(keys, 1, files_with(ECHO))))
        assert served.current.get("echo_pushed") is not None
        assert served.current.get("search_sources") is not None
        assert served.number == 1

    def test_refuses_unsigned_tampered_foreign_and_older_bundles(
        self, served: ServedRegistry, keys: Path, tmp_path: Path
    ) -> None:
        good = signed(keys, 2, files_with(ECHO))
        assert served.offer(entry(1, good))
        active = served.current
        unsigned = msgspec.structs.replace(good, signature="", number=3)
        other = dict(ECHO, allowed_agents=["*"])
        tampered = msgspec.structs.replace(good, files=files_with(other), number=3)
        foreign_key, _ = ensure_signing_key(REGISTRY_BUNDLE, tmp_path / "elsewhere")
        foreign = sign_bundle(REGISTRY_BUNDLE, files_with(other), "v", foreign_key, number=3)
        policy_key, _ = ensure_signing_key(POLICY_BUNDLE, keys)
        # Signed with the policy key under the policy domain: not a registry.
        as_policy = sign_bundle(POLICY_BUNDLE, files_with(other), "v", policy_key, number=3)
        older = signed(keys, 1, files_with(other))
        same = signed(keys, 2, files_with(other))
        for revision, bad in enumerate(
            [unsigned, tampered, foreign, as_policy, older, same, b"{not json"], start=2
        ):
            assert not served.offer(entry(revision, bad))
            assert served.current is active
        assert not served.offer(ActiveEntry(revision=20, value=None, deleted=True))
        assert served.current is active

    def test_refuses_an_invalid_registry_even_signed(
        self, served: ServedRegistry, keys: Path
    ) -> None:
        broken = dict(ECHO, risk="apocalyptic")
        assert not served.offer(entry(1, signed(keys, 1, files_with(broken))))
        clash = dict(ECHO, name="search_sources")  # a built-in tool's name
        assert not served.offer(entry(2, signed(keys, 2, files_with(clash))))
        assert served.stored is None

    def test_a_start_keeps_the_recorded_version_over_an_older_stored_one(
        self, served: ServedRegistry, keys: Path
    ) -> None:
        newer = signed(keys, 5, files_with(ECHO))
        older = signed(keys, 4, files_with(dict(ECHO, name="echo_older")))
        served.begin(entry(9, older), msgspec.json.encode(newer))
        assert served.number == 5
        assert served.current.get("echo_pushed") is not None
        assert served.current.get("echo_older") is None

    def test_a_start_with_nothing_trustworthy_refuses(
        self, served: ServedRegistry, keys: Path
    ) -> None:
        unsigned = msgspec.structs.replace(signed(keys, 1, files_with(ECHO)), signature="")
        with pytest.raises(RegistryStateError):
            served.begin(entry(1, unsigned), None)

    def test_nothing_pushed_serves_the_local_registry(self, served: ServedRegistry) -> None:
        served.begin(None, None)
        assert served.number == 0
        assert served.current is served.local


class TestListing:
    def test_an_agent_sees_only_its_tools_and_no_implementation(self, keys: Path) -> None:
        registry = registry_from_files(files_with(ECHO), builtin_tools=True)
        mine = listing_for(registry, "acme", "researcher", 3)
        theirs = listing_for(registry, "acme", "writer", 3)
        assert "echo_pushed" in {t.name for t in mine.tools}
        assert "echo_pushed" not in {t.name for t in theirs.tools}
        encoded = msgspec.json.encode(mine).decode()
        assert "tests.tools.faulty" not in encoded and "count_runs" not in encoded
        rebuilt = registry_of_listing(mine)
        assert [s.name for s in rebuilt.visible_to("researcher")] == [t.name for t in mine.tools]

    def test_a_registry_directory_needs_tool_files(self, tmp_path: Path) -> None:
        with pytest.raises(RegistryError):
            read_registry_dir(tmp_path)
        assert read_registry_dir(BUILTIN_TOOLS_DIR)
