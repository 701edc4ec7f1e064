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
