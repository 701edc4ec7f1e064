"""search_sources: full-text search over a local corpus of technical documents.

The corpus is a directory of .md / .txt files, each opening with a small
front matter block:

    ---
    title: Sessions
    url: https://openai.github.io/openai-agents-python/sessions/
    source_type: official
    ---
    body...

The index is SQLite FTS5 (stdlib sqlite3), ranked with bm25.

Why an in-memory index, not a file under ctx.data_dir: the corpus is small
(documents, not a web crawl), so building the index takes milliseconds, and
the files themselves stay the single source of truth. A file DB would have to
be kept consistent with the corpus across several executor processes writing
it at once; an in-memory DB per process has nothing to keep consistent and
nothing to clean up. It is built on first use, cached per corpus directory,
and rebuilt when a file is added, removed or modified.
"""

from __future__ import annotations

import re
import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from toolgate.contracts.tooling import ToolContext, ToolUnavailable

SHIPPED_CORPUS = Path(__file__).parent / "corpus"
CORPUS_SUFFIXES = (".md", ".txt")
SOURCE_TYPES = ("official", "community")

# A model's query is free text; only this many words of it go into the FTS
# query, so a pathological query cannot make a pathological FTS expression.
MAX_QUERY_TOKENS = 32
SNIPPET_TOKENS = 24

# A signature of the corpus: (relative path, mtime_ns, size) of every file.
Signature = tuple[tuple[str, int, int], ...]


@dataclass
class _Index:
    signature: Signature
    conn: sqlite3.Connection
    # One sqlite3 connection is shared by the executor's worker threads; the
    # lock serialises them (a query takes well under a millisecond).
    lock: threading.Lock


_indexes: dict[Path, _Index] = {}
_indexes_lock = threading.Lock()


def search_sources(arguments: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    corpus_dir = _corpus_dir(ctx)
    fts_query = to_fts_query(arguments["query"])
    if not fts_query:
        # Nothing searchable in the query (only punctuation, say): no match.
        return {"items": []}
    limit = max(1, min(int(arguments.get("limit", 5)), 10))
    only_official = arguments.get("source_type", "any") == "official"

    index = _get_index(corpus_dir)
    sql = (
        "SELECT title, url, source_type,"
        f" snippet(docs, 1, '', '', '…', {SNIPPET_TOKENS})"
        " FROM docs WHERE docs MATCH ?"
        + (" AND source_type = 'official'" if only_official else "")
        # bm25: smaller is better. A hit in the title weighs more than one in the body.
        + " ORDER BY bm25(docs, 5.0, 1.0) LIMIT ?"
    )
    try:
        with index.lock:
            rows = index.conn.execute(sql, (fts_query, limit)).fetchall()
    except sqlite3.Error as exc:
        # to_fts_query quotes every token, so this is not the query's fault.
        raise ToolUnavailable(f"search index failed: {exc}") from exc
    return {
        "items": [
            {"title": title, "url": url, "source_type": source_type, "snippet": _squash(snip)}
            for title, url, source_type, snip in rows
        ]
    }


def to_fts_query(text: str) -> str:
    """Turn free text into an FTS5 query that cannot be a syntax error.

    Each word becomes a quoted string ("agents"), and the strings are OR-ed:
    FTS5 operators (AND, OR, NEAR, *, ^, :, parentheses) in a model's query
    are then searched as words or dropped, never parsed. bm25 still ranks the
    documents that match more of the words first.
    """
    tokens = re.findall(r"\w+", text)[:MAX_QUERY_TOKENS]
    # \w never matches a double quote, so no token needs escaping.
    return " OR ".join(f'"{token}"' for token in tokens)


def _corpus_dir(ctx: ToolContext) -> Path:
    configured = str(ctx.settings.get("corpus_dir") or "").strip()
    corpus_dir = Path(configured).expanduser() if configured else SHIPPED_CORPUS
    if not corpus_dir.is_dir():
        # An operator's configuration problem, not the request's fault.
        raise ToolUnavailable(f"corpus directory not found: {corpus_dir}")
    return corpus_dir.resolve()


def _corpus_files(corpus_dir: Path) -> list[Path]:
    return sorted(
        p for p in corpus_dir.rglob("*") if p.suffix.lower() in CORPUS_SUFFIXES and p.is_file()
    )


def _signature(corpus_dir: Path, files: list[Path]) -> Signature:
    signature = []
    for path in files:
        stat = path.stat()
        signature.append((str(path.relative_to(corpus_dir)), stat.st_mtime_ns, stat.st_size))
    return tuple(signature)


def _get_index(corpus_dir: Path) -> _Index:
    # Listing and stat-ing a few dozen files on each call is cheap, and it is
    # what lets an operator edit the corpus without restarting the executor.
    files = _corpus_files(corpus_dir)
    signature = _signature(corpus_dir, files)
    # Held while building, so concurrent first calls build the index once.
    with _indexes_lock:
        index = _indexes.get(corpus_dir)
        if index is None or index.signature != signature:
            index = _Index(signature, _build_index(files), threading.Lock())
            # The replaced connection is closed by garbage collection once no
            # in-flight query holds it.
            _indexes[corpus_dir] = index
        return index


def _build_index(files: list[Path]) -> sqlite3.Connection:
    conn = sqlite3.connect(":memory:", check_same_thread=False)
    # porter: "sessions" finds "session". url and source_type are stored, not searched.
    conn.execute(
        "CREATE VIRTUAL TABLE docs USING fts5("
        "title, body, url UNINDEXED, source_type UNINDEXED,"
        " tokenize = 'porter unicode61 remove_diacritics 2')"
    )
    for path in files:
        try:
            raw = path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue  # removed between listing and reading; the next call rebuilds
        meta, body = parse_document(raw)
        conn.execute(
            "INSERT INTO docs (title, body, url, source_type) VALUES (?, ?, ?, ?)",
            (
                meta.get("title") or path.stem.replace("-", " "),
                markdown_to_text(body),
                meta.get("url", ""),
                # Only a document that says it is official counts as official.
                "official" if meta.get("source_type") == "official" else "community",
            ),
        )
    conn.commit()
    return conn


def parse_document(raw: str) -> tuple[dict[str, str], str]:
    """Split a corpus file into its front matter (key: value lines) and its body."""
    lines = raw.splitlines()
    if not lines or lines[0].strip() != "---":
        return {}, raw
    meta: dict[str, str] = {}
    for number, line in enumerate(lines[1:], start=1):
        if line.strip() == "---":
            return meta, "\n".join(lines[number + 1 :])
        key, sep, value = line.partition(":")
        if sep:
            meta[key.strip().lower()] = value.strip().strip("\"'")
    # No closing marker: not front matter after all.
    return {}, raw


_MD_RULES = [
    (re.compile(r"^\s*(```|~~~).*$", re.MULTILINE), ""),  # code fence markers
    (re.compile(r"!?\[([^\]]*)\]\([^)]*\)"), r"\1"),  # [text](url) -> text
    (re.compile(r"^\s{0,3}#{1,6}\s*", re.MULTILINE), ""),  # heading markers
    (re.compile(r"^\s*>\s?", re.MULTILINE), ""),  # block quotes
    (re.compile(r"^\s*[-*+]\s+", re.MULTILINE), ""),  # list bullets
    (re.compile(r"[`*]+|(?<!\w)_+|_+(?!\w)"), ""),  # code, emphasis (not snake_case)
]


def markdown_to_text(body: str) -> str:
    """Strip the markdown markup a snippet would otherwise show the model."""
    for pattern, replacement in _MD_RULES:
        body = pattern.sub(replacement, body)
    return body


def _squash(text: str) -> str:
    return " ".join(text.split())
