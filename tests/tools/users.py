"""A tool that acts for the end user and says what it was given. Test only.

It returns the user it runs for and the SHA-256 of the user token it received
(`ToolContext.subject_token`), never the token: the test compares the hash.
"""

from __future__ import annotations

import hashlib
from typing import Any

from toolgate.contracts.tooling import ToolContext


def whoami(arguments: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    token = ctx.subject_token
    return {
        "user": ctx.principal.user,
        "token_sha256": hashlib.sha256(token.encode()).hexdigest() if token else "",
    }
