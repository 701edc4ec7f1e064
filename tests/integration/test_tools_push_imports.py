"""`toolgate tools push DIR` imports a tool's function as the services do.

The README saves its tool's module, my_tools.py, in the folder where `toolgate up`
runs: the services start there as `python -m`, so they import it. `tools push`, run
as the `toolgate` script from that same folder, could not (the script has only its
bin folder on sys.path) and refused the README's own tool. The push is checked here
up to the bus: nothing listens at the NATS URL, so a registry that passed its checks
ends in "cannot connect", exit 3.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.harness import REPO_ROOT
from toolgate.stack.nats_server import free_port

SCRIPT = Path(sys.executable).parent / "toolgate"


def readme_file(name: str) -> str:
    """The README block saved as `name` (<!-- test: file NAME -->)."""
    text = (REPO_ROOT / "README.md").read_text()
    found = re.search(rf"<!-- test: file {re.escape(name)} -->\n```\w+\n(.*?)```", text, re.S)
    assert found, name
    return found.group(1)


def test_the_readmes_tool_is_pushed_from_the_folder_it_is_saved_in(tmp_path: Path) -> None:
    (tmp_path / "my_tools.py").write_text(readme_file("my_tools.py"))
    (tmp_path / "tools").mkdir()
    (tmp_path / "tools" / "create_ticket.yaml").write_text(readme_file("tools/create_ticket.yaml"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOOLGATE_")}
    env.pop("PYTHONPATH", None)  # as a user's shell: nothing but the venv
    nowhere = f"nats://127.0.0.1:{free_port()}"
    done = subprocess.run(
        [str(SCRIPT), "tools", "push", "tools", "--nats-url", nowhere, "--connect-timeout", "1"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "cannot be imported" not in done.stderr, done.stderr
    assert done.returncode == 3, done.stderr
    assert f"cannot connect to NATS at {nowhere}" in done.stderr
