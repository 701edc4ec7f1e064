"""Who may do what on the embedded ClickHouse: three users with passwords; `default` only
for the engine's own in-process session, never over HTTP.

The roles (the same users and grants exist as DDL for an external server in
infra/clickhouse/access/):

| role | user | may |
| --- | --- | --- |
| writer | toolgate_writer | INSERT into event_log and chain_checkpoints, read schema_versions |
| auditor | toolgate_auditor | SELECT on the audit database |
| admin | toolgate_admin | DDL on the audit database (create, alter, drop), INSERT, SELECT |

None of them may use a table function (no CREATE TEMPORARY TABLE, no READ ON
FILE/URL/...), KILL someone else's query or run SYSTEM commands; only the
admin changes the schema.

What the embedded engine honours (../shared/notes/embedded-clickhouse-auth.md):
users in a users.xml named by `user_directories` (not `<users>` in config.xml),
and the in-process session always logs in as a passwordless `default` that
counts as loopback (a password, other `<networks>` or a reload of users.xml
after start all fail or are ignored). So `default` keeps a login with nothing
but what that session needs: SYSTEM LISTEN (to open the listener) and SELECT
on system.numbers (what the keep-alive query reads). HTTP never reaches it:
the server's HTTP handlers (`http_handlers`) answer only a request that names
a toolgate user in `X-ClickHouse-User` (which ClickHouse refuses to combine
with a user in the URL or an Authorization header), and `/ping`; any other
request, `default`'s included, gets 403 before it is authenticated.

Passwords are generated once into `logins.json` (mode 0600) beside the data;
users.xml keeps only their SHA-256. Pure logic but the file writes.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit
from xml.sax.saxutils import escape

LOGINS_FILE = "logins.json"
ROLES = ("admin", "writer", "auditor")
USER_PREFIX = "toolgate_"
# What the DDL sets create (single: MergeTree; cluster: the replicated ones behind Distributed;
# AggregatingMergeTree for call_stages, DDL 008).
TABLE_ENGINES = (
    "MergeTree",
    "ReplicatedMergeTree",
    "AggregatingMergeTree",
    "ReplicatedAggregatingMergeTree",
    "Distributed",
)


def user_of(role: str) -> str:
    if role not in ROLES:
        raise ValueError(f"no ClickHouse role {role!r} (one of {', '.join(ROLES)})")
    return USER_PREFIX + role


def grants(role: str, database: str = "*") -> list[str]:
    """The GRANT statements of `role` on `database` (`*`: every database)."""
    on = f"{database}.*" if database == "*" else f"`{database}`.*"
    table = (lambda name: f"*.{name}") if database == "*" else (lambda name: f"`{database}`.{name}")
    user = user_of(role)
    if role == "writer":
        return [
            f"GRANT INSERT ON {table('event_log')} TO {user}",
            f"GRANT INSERT ON {table('chain_checkpoints')} TO {user}",
            f"GRANT SELECT ON {table('schema_versions')} TO {user}",
        ]
    if role == "auditor":
        return [f"GRANT SELECT, SHOW TABLES ON {on} TO {user}"]
    return [
        f"GRANT SELECT, INSERT, ALTER, CREATE DATABASE, CREATE TABLE, CREATE VIEW, DROP TABLE, "
        f"DROP VIEW, DROP DATABASE, TRUNCATE, OPTIMIZE, SHOW ON {on} TO {user}",
        *(f"GRANT TABLE ENGINE ON {engine} TO {user}" for engine in TABLE_ENGINES),
    ]


def access_ddl(database: str = "toolgate", cluster: str = "") -> str:
    """The same users and grants as DDL, for an external server or cluster
    (infra/clickhouse/access/*.sql; passwords as ${admin_password} ... placeholders).

    On a cluster the writer also inserts into the shards' local tables (a Distributed
    insert runs as the same user on every node)."""
    on_cluster = f" ON CLUSTER '{cluster}'" if cluster else ""
    lines = [
        "-- toolgate's ClickHouse users: an insert-only writer (the audit sink), a read-only",
        "-- auditor (toolgate audit ..., policy test), an admin for the DDL. None may use a",
        "-- table function that reads or writes outside (no READ/WRITE ON FILE, URL, S3, ...),",
        "-- kill another user's query or run SYSTEM. Run as a user with access management,",
        "-- with the three ${..._password} placeholders replaced; give each service its URL:",
        "--   http://toolgate_writer:PASSWORD@HOST:8123/" + database + "  (toolgate serve audit)",
        "-- ClickHouse's own `default` user needs none of this: give it a password or drop it",
        "-- (toolgate never logs in as `default`).",
        "-- Rendered by toolgate.stack.clickhouse_access.access_ddl (a test keeps it in step).",
    ]
    for role in ROLES:
        lines.append(
            f"CREATE USER IF NOT EXISTS {user_of(role)}{on_cluster} "
            f"IDENTIFIED WITH sha256_password BY '${{{role}_password}}';"
        )
    for role in ROLES:
        statements = grants(role, "*" if role == "admin" else database)
        if cluster and role == "writer":
            statements += [
                g.replace("event_log", "event_log_local").replace(
                    "chain_checkpoints", "chain_checkpoints_local"
                )
                for g in statements
                if "INSERT" in g
            ]
        for grant in statements:
            lines.append(grant.replace("GRANT ", f"GRANT{on_cluster} ", 1) + ";")
    return "\n".join(lines) + "\n"


def server_grants() -> list[str]:
    """What the embedded server's own stop needs besides the admin's DDL: to end its
    keep-alive query (which runs as `default`). Not part of the external-server DDL."""
    user = user_of("admin")
    return [f"GRANT KILL QUERY ON *.* TO {user}", f"GRANT SELECT ON system.processes TO {user}"]


def ensure_logins(directory: Path) -> dict[str, str]:
    """role -> password, generated once into DIR/logins.json (0600) and kept.

    The file maps each role to {"user": ..., "password": ...}, the form
    runtime.settings.clickhouse_login reads for the services and the CLI."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / LOGINS_FILE
    found = read_logins(path)
    if all(found.get(r) for r in ROLES):
        return found
    logins = {r: found.get(r) or secrets.token_urlsafe(24) for r in ROLES}
    tmp = path.with_name(f".{LOGINS_FILE}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        json.dump({r: {"user": user_of(r), "password": p} for r, p in logins.items()}, handle)
    tmp.replace(path)
    return logins


def read_logins(path: Path) -> dict[str, str]:
    """role -> password from a logins file ({} if absent or unreadable)."""
    try:
        found = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(found, dict):
        return {}
    return {
        role: entry["password"]
        for role, entry in found.items()
        if role in ROLES and isinstance(entry, dict) and isinstance(entry.get("password"), str)
    }


def with_login(url: str, role: str, password: str) -> str:
    """`url` logging in as `role` (an URL that names a user already is left alone)."""
    parts = urlsplit(url)
    if parts.username:
        return url
    netloc = f"{quote(user_of(role), safe='')}:{quote(password, safe='')}@{parts.netloc}"
    return urlunsplit(parts._replace(netloc=netloc))


# Full-match RE2 of the X-ClickHouse-User header values the HTTP handlers let through.
HTTP_USER_PATTERN = USER_PREFIX + "[a-z]+"
# What any other request gets (403; the code, AUTHENTICATION_FAILED, also in the
# X-ClickHouse-Exception-Code header, where clients read it).
HTTP_REFUSAL = (
    "Code: 516. DB::Exception: ACCESS_DENIED: this server answers only toolgate's users, "
    "named in the X-ClickHouse-User and X-ClickHouse-Key headers. (AUTHENTICATION_FAILED)"
)


def http_handlers_xml() -> str:
    """The embedded server's HTTP handlers: `/ping`, and queries that log in as a toolgate
    user with X-ClickHouse-User/X-ClickHouse-Key; everything else 403 (no `default`, no
    play UI, no dashboard). Basic auth is not among them: ClickHouse lets `?user=` in the
    URL override it, so `default` would come back through it."""
    return f"""
    <http_handlers>
        <rule>
            <url>/ping</url>
            <methods>GET,HEAD</methods>
            <handler><type>static</type><status>200</status>
                <content_type>text/plain; charset=UTF-8</content_type>
                <response_content>Ok.\n</response_content></handler>
        </rule>
        <rule>
            <headers><X-ClickHouse-User>regex:{HTTP_USER_PATTERN}</X-ClickHouse-User></headers>
            <handler><type>dynamic_query_handler</type>
                <query_param_name>query</query_param_name></handler>
        </rule>
        <rule>
            <handler><type>static</type><status>403</status>
                <content_type>text/plain; charset=UTF-8</content_type>
                <http_response_headers>
                    <X-ClickHouse-Exception-Code>516</X-ClickHouse-Exception-Code>
                </http_response_headers>
                <response_content>{HTTP_REFUSAL}\n</response_content></handler>
        </rule>
    </http_handlers>"""


def users_xml(logins: dict[str, str], database: str = "*") -> str:
    """The users.xml the embedded server loads (passwords only as SHA-256)."""
    loopback = "<networks><ip>127.0.0.1</ip><ip>::1</ip></networks>"
    users = [
        "<default><password></password>"
        + loopback
        + "<profile>default</profile><quota>default</quota><grants>"
        "<query>GRANT SYSTEM LISTEN ON *.*</query>"
        "<query>GRANT SELECT ON system.numbers</query>"
        "</grants></default>"
    ]
    for role in ROLES:
        digest = hashlib.sha256(logins[role].encode()).hexdigest()
        # The admin's DDL covers every database of the server (tests make their own).
        own = grants(role, "*") + server_grants() if role == "admin" else grants(role, database)
        queries = "".join(f"<query>{escape(g.rsplit(' TO ', 1)[0])}</query>" for g in own)
        users.append(
            f"<{user_of(role)}><password_sha256_hex>{digest}</password_sha256_hex>"
            f"{loopback}<profile>default</profile><quota>default</quota>"
            f"<grants>{queries}</grants></{user_of(role)}>"
        )
    return (
        "<clickhouse>\n<profiles><default></default></profiles>\n"
        "<quotas><default></default></quotas>\n<users>\n"
        + "\n".join(users)
        + "\n</users>\n</clickhouse>\n"
    )
