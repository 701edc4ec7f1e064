"""The built-in tools, called directly with a ToolContext on tmp_path."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import jsonschema_rs
import pytest

from toolgate.contracts.calls import Principal
from toolgate.contracts.registry import load_registry
from toolgate.contracts.tooling import ToolContext, ToolRefused
from toolgate.services.executor.tools.echo import echo
from toolgate.services.executor.tools.fetch_document import fetch_document
from toolgate.services.executor.tools.save_evidence import read_evidence, save_evidence
from toolgate.services.executor.tools.search_sources import search_sources, to_fts_query

REGISTRY = load_registry()
PRINCIPAL = Principal(tenant="acme", user="u1", agent="researcher", session="s1")


def make_ctx(
    tmp_path: Path,
    tool: str,
    settings: dict[str, Any] | None = None,
    call_id: str = "call_1",
    task_id: str | None = "task_1",
) -> ToolContext:
    spec = REGISTRY.get(tool)
    assert spec is not None
    return ToolContext(
        call_id=call_id,
        tool=tool,
        principal=PRINCIPAL,
        task_id=task_id,
        data_dir=tmp_path / "tools" / tool,
        settings=spec.settings if settings is None else settings,
    )


def assert_matches_output_schema(tool: str, output: dict[str, Any]) -> None:
    spec = REGISTRY.get(tool)
    assert spec is not None
    validator = jsonschema_rs.validator_for(spec.output_schema)
    assert validator.is_valid(output), list(validator.iter_errors(output))


# --- echo -------------------------------------------------------------------


def test_echo_returns_payload_unchanged(tmp_path: Path) -> None:
    payload = {"a": [1, 2, {"b": None}], "c": "text"}
    out = echo({"payload": payload}, make_ctx(tmp_path, "echo"))
    assert out == {"payload": payload}
    assert_matches_output_schema("echo", out)


def test_echo_without_payload_returns_empty_object(tmp_path: Path) -> None:
    out = echo({}, make_ctx(tmp_path, "echo"))
    assert out == {}
    assert_matches_output_schema("echo", out)


# --- search_sources -----------------------------------------------------------


def search(tmp_path: Path, query: str, source_type: str = "any", limit: int = 5, **settings):
    ctx = make_ctx(tmp_path, "search_sources", settings={"corpus_dir": "", **settings})
    out = search_sources({"query": query, "source_type": source_type, "limit": limit}, ctx)
    assert_matches_output_schema("search_sources", out)
    return out


def test_search_finds_official_agents_sdk_doc_for_state_management(tmp_path: Path) -> None:
    out = search(tmp_path, "OpenAI Agents SDK state management", source_type="official")
    assert out["items"], "expected at least one result"
    first = out["items"][0]
    assert first["source_type"] == "official"
    assert first["url"].startswith("https://openai.github.io/openai-agents-python/")
    assert all(item["source_type"] == "official" for item in out["items"])


def test_search_snippet_is_plain_text(tmp_path: Path) -> None:
    out = search(tmp_path, "OpenAI Agents SDK sessions", limit=10)
    for item in out["items"]:
        assert item["snippet"]
        assert not any(mark in item["snippet"] for mark in ("<b>", "```", "**", "\n"))


def test_search_any_includes_community_sources(tmp_path: Path) -> None:
    out = search(tmp_path, "idempotency keys retries", limit=10)
    assert "community" in {item["source_type"] for item in out["items"]}


def test_search_respects_limit(tmp_path: Path) -> None:
    # "the" is in nearly every document, so the limit is what stops the results.
    out = search(tmp_path, "the agent tool", limit=2)
    assert len(out["items"]) == 2


def test_search_with_no_match_returns_empty_items(tmp_path: Path) -> None:
    assert search(tmp_path, "xyzzyplugh quuxblarg") == {"items": []}


@pytest.mark.parametrize(
    "query",
    [
        '"AND OR NEAR( *',
        "title:foo^ -bar",
        '"""',
        "((()))",
        "NOT",
        "a*b*c",
        "');DROP TABLE docs;--",
    ],
)
def test_search_with_hostile_fts_input_does_not_raise(tmp_path: Path, query: str) -> None:
    out = search(tmp_path, query)
    assert isinstance(out["items"], list)


def test_fts_query_quotes_every_token() -> None:
    assert to_fts_query('"AND OR NEAR( *') == '"AND" OR "OR" OR "NEAR"'
    assert to_fts_query("*** ()") == ""


def test_search_uses_configured_corpus_and_rebuilds_when_a_file_changes(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    doc = corpus / "one.md"
    doc.write_text(
        "---\ntitle: Walrus care\nurl: https://example.org/walrus\nsource_type: community\n---\n"
        "Walruses need cold water.\n"
    )
    out = search(tmp_path, "walrus", corpus_dir=str(corpus))
    assert [item["url"] for item in out["items"]] == ["https://example.org/walrus"]
    # Official-only excludes the community document.
    assert search(tmp_path, "walrus", source_type="official", corpus_dir=str(corpus)) == {
        "items": []
    }

    (corpus / "two.txt").write_text(
        "---\ntitle: Penguin care\nurl: https://example.org/penguin\nsource_type: official\n---\n"
        "Penguins also need cold water.\n"
    )
    out = search(tmp_path, "penguin", corpus_dir=str(corpus))
    assert [item["title"] for item in out["items"]] == ["Penguin care"]


# --- fetch_document -----------------------------------------------------------

PAGE = b"""<!doctype html>
<html><head><title>  Test   Page </title>
<style>body { color: red; }</style>
<script>var secret = "do not show";</script>
</head>
<body><h1>Heading</h1><p>First   paragraph
with   spaces.</p><p>Second &amp; last.</p></body></html>"""


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # the stdlib's name
        if self.path == "/page":
            self._reply(200, "text/html; charset=utf-8", PAGE)
        elif self.path == "/plain":
            self._reply(200, "text/plain", b"x" * 5000)
        elif self.path == "/big":
            self._reply(200, "text/plain", b"y" * 100_000)
        elif self.path == "/image":
            self._reply(200, "image/png", b"\x89PNG")
        elif self.path == "/missing":
            self._reply(404, "text/plain", b"not found")
        elif self.path == "/broken":
            self._reply(503, "text/plain", b"down")
        elif self.path == "/to-page":
            self._redirect("/page")
        elif self.path == "/to-evil":
            self._redirect("http://evil.example/steal")
        elif self.path.startswith("/loop"):
            self._redirect(f"/loop{len(self.path)}")
        else:
            self._reply(404, "text/plain", b"")

    def _reply(self, status: int, content_type: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _redirect(self, location: str) -> None:
        self.send_response(302)
        self.send_header("Location", location)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:  # keep test output quiet
        pass


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


LOCAL = {"allowed_hosts": ["127.0.0.1"], "allow_private_addresses": True, "max_bytes": 2_000_000}


def fetch(tmp_path: Path, url: str, settings: dict[str, Any] = LOCAL, **arguments: Any):
    out = fetch_document({"url": url, **arguments}, make_ctx(tmp_path, "fetch_document", settings))
    assert_matches_output_schema("fetch_document", out)
    return out


def test_fetch_normalizes_html_and_takes_title(tmp_path: Path, server: str) -> None:
    out = fetch(tmp_path, f"{server}/page")
    assert out["status_code"] == 200
    assert out["content_type"] == "text/html"
    assert out["title"] == "Test Page"
    assert out["text"] == "Heading\nFirst paragraph with spaces.\nSecond & last."
    assert "secret" not in out["text"] and "color" not in out["text"]
    assert out["truncated"] is False


def test_fetch_follows_an_allowed_redirect_and_reports_final_url(
    tmp_path: Path, server: str
) -> None:
    out = fetch(tmp_path, f"{server}/to-page")
    assert out["url"] == f"{server}/page"
    assert out["title"] == "Test Page"


def test_fetch_truncates_text_at_max_chars(tmp_path: Path, server: str) -> None:
    out = fetch(tmp_path, f"{server}/plain", max_chars=100)
    assert out["text"] == "x" * 100
    assert out["truncated"] is True


def test_fetch_stops_reading_at_max_bytes(tmp_path: Path, server: str) -> None:
    out = fetch(tmp_path, f"{server}/big", {**LOCAL, "max_bytes": 1000}, max_chars=200_000)
    assert out["text"] == "y" * 1000
    assert out["truncated"] is True


def test_fetch_refuses_host_not_in_allow_list(tmp_path: Path, server: str) -> None:
    settings = {**LOCAL, "allowed_hosts": ["docs.nats.io"]}
    with pytest.raises(ToolRefused, match="not in the allowed hosts"):
        fetch(tmp_path, f"{server}/page", settings)


def test_fetch_refuses_loopback_when_private_addresses_are_not_allowed(
    tmp_path: Path, server: str
) -> None:
    settings = {**LOCAL, "allow_private_addresses": False}
    with pytest.raises(ToolRefused, match="non-public address"):
        fetch(tmp_path, f"{server}/page", settings)


def test_fetch_refuses_redirect_to_disallowed_host(tmp_path: Path, server: str) -> None:
    with pytest.raises(ToolRefused, match="evil.example"):
        fetch(tmp_path, f"{server}/to-evil")


def test_fetch_refuses_more_than_three_redirects(tmp_path: Path, server: str) -> None:
    with pytest.raises(ToolRefused, match="redirects"):
        fetch(tmp_path, f"{server}/loop")


def test_fetch_refuses_unsupported_content_type(tmp_path: Path, server: str) -> None:
    with pytest.raises(ToolRefused, match="unsupported content type image/png"):
        fetch(tmp_path, f"{server}/image")


def test_fetch_refuses_client_error_and_reports_server_error_as_unavailable(
    tmp_path: Path, server: str
) -> None:
    from toolgate.contracts.tooling import ToolUnavailable

    with pytest.raises(ToolRefused, match="404"):
        fetch(tmp_path, f"{server}/missing")
    with pytest.raises(ToolUnavailable, match="503"):
        fetch(tmp_path, f"{server}/broken")


def test_fetch_reports_connection_failure_as_unavailable(tmp_path: Path) -> None:
    from toolgate.contracts.tooling import ToolUnavailable

    # Port 1 on loopback: nothing listens there, the connection is refused.
    with pytest.raises(ToolUnavailable):
        fetch(tmp_path, "http://127.0.0.1:1/")


# --- save_evidence ------------------------------------------------------------


def evidence_args(**overrides: Any) -> dict[str, Any]:
    return {
        "task_id": "task_1",
        "claim": "JetStream drops a publish whose Nats-Msg-Id it saw in the window.",
        "source_url": "https://docs.nats.io/using-nats/developer/develop_jetstream/model_deep_dive",
        "quote": "it is not stored again",
        "confidence": "high",
        **overrides,
    }


def test_save_evidence_stores_once(tmp_path: Path) -> None:
    ctx = make_ctx(tmp_path, "save_evidence")
    out = save_evidence(evidence_args(), ctx)
    assert_matches_output_schema("save_evidence", out)
    assert out["stored"] is True and out["duplicate"] is False
    assert out["task_id"] == "task_1"
    assert out["evidence_id"].startswith("ev_")

    rows = read_evidence(ctx.data_dir, "acme", "task_1")
    assert len(rows) == 1
    assert rows[0]["call_id"] == "call_1"
    assert rows[0]["evidence_id"] == out["evidence_id"]
    assert rows[0]["confidence"] == "high"
    assert (ctx.data_dir / "acme" / "task_1.sqlite3").exists()


def test_save_evidence_second_call_with_same_call_id_is_duplicate(tmp_path: Path) -> None:
    ctx = make_ctx(tmp_path, "save_evidence")
    first = save_evidence(evidence_args(), ctx)
    second = save_evidence(evidence_args(claim="a different claim"), ctx)
    assert_matches_output_schema("save_evidence", second)
    assert second["duplicate"] is True
    assert second["evidence_id"] == first["evidence_id"]
    rows = read_evidence(ctx.data_dir, "acme", "task_1")
    assert len(rows) == 1
    assert rows[0]["claim"] == evidence_args()["claim"]


def test_save_evidence_refuses_another_task(tmp_path: Path) -> None:
    ctx = make_ctx(tmp_path, "save_evidence")
    with pytest.raises(ToolRefused, match="current task"):
        save_evidence(evidence_args(task_id="task_2"), ctx)
    assert read_evidence(ctx.data_dir, "acme", "task_2") == []


def test_save_evidence_refuses_call_without_task(tmp_path: Path) -> None:
    ctx = make_ctx(tmp_path, "save_evidence", task_id=None)
    with pytest.raises(ToolRefused):
        save_evidence(evidence_args(), ctx)


def test_save_evidence_refuses_unsafe_tenant(tmp_path: Path) -> None:
    ctx = make_ctx(tmp_path, "save_evidence")
    ctx = ToolContext(
        call_id=ctx.call_id,
        tool=ctx.tool,
        principal=Principal(tenant="../other", user="u", agent="a", session="s"),
        task_id=ctx.task_id,
        data_dir=ctx.data_dir,
    )
    with pytest.raises(ToolRefused, match="tenant"):
        save_evidence(evidence_args(), ctx)
    assert not (tmp_path / "tools" / "other").exists()


def test_save_evidence_concurrent_writes_are_all_stored(tmp_path: Path) -> None:
    errors: list[BaseException] = []
    results: list[dict[str, Any]] = []
    start = threading.Barrier(8)

    def write(n: int) -> None:
        ctx = make_ctx(tmp_path, "save_evidence", call_id=f"call_{n}")
        start.wait()
        try:
            results.append(save_evidence(evidence_args(claim=f"claim {n}"), ctx))
        except BaseException as exc:  # reported below, not lost in the thread
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert errors == []
    assert all(r["duplicate"] is False for r in results)
    rows = read_evidence(tmp_path / "tools" / "save_evidence", "acme", "task_1")
    assert sorted(row["call_id"] for row in rows) == sorted(f"call_{n}" for n in range(8))
