"""A one-shot `toolgate` command loads only what it runs: every command builds the whole
parser (each group registers its flags), so a group's heavy imports (faststream, the
policy service's cedarpy and httpx, clickhouse-connect) stay inside its commands. Each
`toolgate call` the tests and the docs pages run paid about 0.6 CPU-s for them."""

from __future__ import annotations

import json
import subprocess
import sys

# Loaded by the services and by the commands that need them, never by the parser.
NOT_FOR_EVERY_COMMAND = ("faststream", "cedarpy", "httpx", "clickhouse_connect")


def test_building_the_parser_imports_no_service_library() -> None:
    script = (
        "import json, sys\n"
        "from toolgate.cli.main import full_parser\n"
        "full_parser()\n"
        "print(json.dumps(sorted({name.split('.')[0] for name in sys.modules})))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    )
    loaded = set(json.loads(done.stdout))
    assert not loaded & set(NOT_FOR_EVERY_COMMAND), sorted(loaded & set(NOT_FOR_EVERY_COMMAND))


def test_the_validator_executor_and_policy_import_no_http_or_token_library() -> None:
    """httpx and PyJWT load where they are used (a user's token checked: runtime/oidc.py; a
    policy's HTTP lookup: services/policy/providers.py), not with the service: most
    gateways have neither, and every gateway a test starts paid for them in three
    processes (httpx also loads its command line's rich, pygments and click when they
    are installed, as the test extras install them)."""
    script = (
        "import json, sys\n"
        "import toolgate.services.validator.app, toolgate.services.executor.app\n"
        "import toolgate.services.policy.app\n"
        "print(json.dumps(sorted({name.split('.')[0] for name in sys.modules})))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    )
    loaded = set(json.loads(done.stdout))
    assert not loaded & {"httpx", "jwt"}, sorted(loaded & {"httpx", "jwt"})
