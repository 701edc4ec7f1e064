"""`toolgate tools import-openapi`'s pure part: OpenAPI 3.0 / 3.1 operations to registry
entries (each one a valid ToolSpec), and what is refused, per operation, with a reason."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import jsonschema_rs
import pytest
import yaml

from toolgate.cli.openapi import NotImportable, import_operations, load_document, tool_name
from toolgate.contracts.registry import ToolSpec

ORDER = {
    "type": "object",
    "properties": {
        "id": {"type": "string"},
        "total": {"type": "number", "minimum": 0, "exclusiveMinimum": True},
        "note": {"type": "string", "nullable": True},
        "lines": {"type": "array", "items": {"$ref": "#/components/schemas/Line"}},
    },
    "required": ["id"],
}
SPEC_30: dict[str, Any] = {
    "openapi": "3.0.3",
    "info": {"title": "Shop", "version": "1"},
    "servers": [
        {"url": "https://{region}.shop.example/v1", "variables": {"region": {"default": "eu"}}}
    ],
    "paths": {
        "/orders/{orderId}": {
            "parameters": [
                {"name": "orderId", "in": "path", "required": True, "schema": {"type": "string"}}
            ],
            "get": {
                "operationId": "getOrder",
                "summary": "Read one order.",
                "description": "Use for one known id.",
                "parameters": [
                    {"$ref": "#/components/parameters/Expand"},
                    {"name": "X-Trace", "in": "header", "schema": {"type": "string"}},
                ],
                "responses": {
                    "200": {
                        "description": "ok",
                        "content": {
                            "application/json": {"schema": {"$ref": "#/components/schemas/Order"}}
                        },
                    },
                    "404": {"description": "no"},
                },
            },
            "head": {"responses": {"200": {"description": "exists"}}},
            "delete": {"operationId": "cancelOrder", "responses": {"204": {"description": "gone"}}},
            "put": {
                "operationId": "replaceOrder",
                "requestBody": {
                    "required": True,
                    "content": {
                        "application/json": {"schema": {"$ref": "#/components/schemas/Order"}}
                    },
                },
                "parameters": [{"name": "dryRun", "in": "query", "schema": {"type": "boolean"}}],
                "responses": {
                    "201": {
                        "description": "ok",
                        "content": {
                            "application/json": {"schema": {"$ref": "#/components/schemas/Order"}}
                        },
                    }
                },
            },
        },
        "/trees": {
            "get": {
                "operationId": "listTrees",
                "responses": {
                    "200": {
                        "description": "ok",
                        "content": {
                            "application/json": {"schema": {"$ref": "#/components/schemas/Node"}}
                        },
                    }
                },
            },
            "post": {
                "operationId": "uploadTree",
                "requestBody": {
                    "required": True,
                    "content": {"multipart/form-data": {"schema": {"type": "object"}}},
                },
                "responses": {"200": {"description": "ok"}},
            },
        },
        "/signed": {
            "get": {
                "operationId": "signed",
                "parameters": [
                    {
                        "name": "X-Sig",
                        "in": "header",
                        "required": True,
                        "schema": {"type": "string"},
                    }
                ],
                "responses": {"200": {"description": "ok"}},
            }
        },
        "/report": {
            "get": {
                "operationId": "report",
                "responses": {"200": {"description": "csv", "content": {"text/csv": {}}}},
            }
        },
    },
    "components": {
        "parameters": {
            "Expand": {
                "name": "expand",
                "in": "query",
                "description": "Include the lines.",
                "schema": {"type": "array", "items": {"type": "string", "enum": ["lines"]}},
            }
        },
        "schemas": {
            "Order": ORDER,
            "Line": {"type": "object", "properties": {"sku": {"type": "string"}}},
            "Node": {
                "type": "object",
                "properties": {
                    "children": {"type": "array", "items": {"$ref": "#/components/schemas/Node"}}
                },
            },
        },
    },
}


def by_name(
    document: dict[str, Any], **options: Any
) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    done = import_operations(document, "shop", **options)
    return {e["name"]: e for e in done.entries}, dict(done.skipped)


def test_each_importable_operation_becomes_a_valid_entry() -> None:
    entries, skipped = by_name(SPEC_30)
    assert sorted(entries) == [
        "shop_cancel_order",
        "shop_get_order",
        "shop_head_orders_order_id",
        "shop_replace_order",
    ]
    for entry in entries.values():
        ToolSpec.model_validate(entry)
    get = entries["shop_get_order"]
    assert get["http"] == {
        "method": "GET",
        "url": "https://eu.shop.example/v1/orders/{orderId}",
        "query": ["expand"],
    }
    assert get["description"] == "Read one order.\n\nUse for one known id."
    assert get["input_schema"]["required"] == ["orderId"]
    assert get["input_schema"]["properties"]["expand"]["description"] == "Include the lines."
    assert "X-Trace" not in get["input_schema"]["properties"]  # no header from the model
    assert set(skipped) == {
        "GET /trees (listTrees)",
        "POST /trees (uploadTree)",
        "GET /signed (signed)",
        "GET /report (report)",
    }


def test_reads_come_in_low_risk_and_writes_high_risk_with_approval() -> None:
    entries, _ = by_name(SPEC_30)
    for name in ("shop_get_order", "shop_head_orders_order_id"):
        assert entries[name]["read_only"] and entries[name]["risk"] == "low"
        assert not entries[name]["requires_approval"]
    for name in ("shop_cancel_order", "shop_replace_order"):
        entry = entries[name]
        assert not entry["read_only"] and entry["risk"] == "high" and entry["requires_approval"]
        assert not entry["idempotent"]


def test_schemas_are_resolved_and_translated_to_json_schema() -> None:
    entries, _ = by_name(SPEC_30)
    output = entries["shop_get_order"]["output_schema"]
    assert output["properties"]["lines"]["items"]["properties"] == {"sku": {"type": "string"}}
    assert output["properties"]["note"]["type"] == ["string", "null"]  # 3.0 nullable
    assert output["properties"]["total"] == {"type": "number", "exclusiveMinimum": 0}
    check = jsonschema_rs.validator_for(output)
    assert check.is_valid({"id": "o", "note": None, "total": 1})
    assert not check.is_valid({"id": "o", "total": 0})
    put = entries["shop_replace_order"]
    assert put["http"] == {
        "method": "PUT",
        "url": "https://eu.shop.example/v1/orders/{orderId}",
        "query": ["dryRun"],
        "body": "body",
    }
    assert put["input_schema"]["required"] == ["orderId", "body"]
    assert put["input_schema"]["properties"]["body"]["required"] == ["id"]
    assert entries["shop_cancel_order"]["output_schema"] == {"type": "null"}  # 204
    assert entries["shop_head_orders_order_id"]["output_schema"] == {"type": "null"}


def test_what_cannot_be_imported_is_skipped_with_its_reason() -> None:
    _, skipped = by_name(SPEC_30)
    assert (
        "recursive ($ref cycle #/components/schemas/Node -> #/components/schemas/Node)"
        in (skipped["GET /trees (listTrees)"])
    )
    assert "multipart/form-data (JSON only)" in skipped["POST /trees (uploadTree)"]
    assert "header parameter 'X-Sig'" in skipped["GET /signed (signed)"]
    assert "text/csv (JSON only)" in skipped["GET /report (report)"]


def test_openapi_31_schemas_pass_and_a_base_url_replaces_the_server() -> None:
    spec = copy.deepcopy(SPEC_30)
    spec["openapi"] = "3.1.0"
    spec["servers"] = [{"url": "/v1"}]  # relative: only with --base-url
    spec["components"]["schemas"]["Order"]["properties"]["note"] = {"type": ["string", "null"]}
    spec["components"]["schemas"]["Order"]["properties"]["total"] = {
        "type": "number",
        "exclusiveMinimum": 0,
    }
    entries, skipped = by_name(spec)
    assert entries == {} and "pass --base-url" in skipped["GET /orders/{orderId} (getOrder)"]
    entries, _ = by_name(spec, base_url="http://127.0.0.1:9/api/")
    get = entries["shop_get_order"]
    assert get["http"]["url"] == "http://127.0.0.1:9/api/orders/{orderId}"
    assert get["output_schema"]["properties"]["note"]["type"] == ["string", "null"]
    assert get["output_schema"]["properties"]["total"]["exclusiveMinimum"] == 0  # as written


def test_an_external_ref_or_a_huge_expansion_is_refused() -> None:
    spec = copy.deepcopy(SPEC_30)
    spec["components"]["schemas"]["Line"] = {"$ref": "other.yaml#/Line"}
    _, skipped = by_name(spec)
    assert "external $ref 'other.yaml#/Line'" in skipped["GET /orders/{orderId} (getOrder)"]
    # Twenty levels, each twice the one below: no cycle, a million nodes expanded.
    schemas = {"L0": {"type": "string"}}
    for level in range(1, 21):
        below = {"$ref": f"#/components/schemas/L{level - 1}"}
        schemas[f"L{level}"] = {"type": "object", "properties": {"a": below, "b": below}}
    spec["components"]["schemas"].update(schemas)
    spec["paths"]["/orders/{orderId}"]["get"]["responses"]["200"]["content"]["application/json"][
        "schema"
    ] = {"$ref": "#/components/schemas/L20"}
    spec["components"]["schemas"]["Line"] = {"type": "object"}
    _, skipped = by_name(spec)
    assert "expand to more than" in skipped["GET /orders/{orderId} (getOrder)"]


def test_names_are_subject_safe_and_prefixed() -> None:
    assert tool_name("shop", "GET", "/x", "getHTTPStatus") == "shop_get_http_status"
    assert tool_name("shop", "GET", "/orders/{id}/lines", None) == "shop_get_orders_id_lines"
    assert tool_name("p", "POST", "/x", "ä-weird id!") == "p_weird_id"
    assert len(tool_name("p", "GET", "/x", "a" * 200)) == 64


def test_documents_are_read_as_json_or_yaml_and_others_are_refused(tmp_path: Path) -> None:
    (tmp_path / "a.json").write_text(json.dumps(SPEC_30))
    (tmp_path / "a.yaml").write_text(yaml.safe_dump(SPEC_30))
    assert load_document(tmp_path / "a.json") == load_document(tmp_path / "a.yaml")
    (tmp_path / "swagger.json").write_text(json.dumps({"swagger": "2.0", "paths": {}}))
    with pytest.raises(
        NotImportable, match=r"not an OpenAPI 3.0 or 3.1 document \(swagger '2.0'\)"
    ):
        load_document(tmp_path / "swagger.json")
    (tmp_path / "list.yaml").write_text("- 1\n")
    with pytest.raises(NotImportable, match="mapping"):
        load_document(tmp_path / "list.yaml")


class TestCommand:
    """`toolgate tools import-openapi`, in process: files written, one-line failures."""

    def run(self, *args: str) -> int:
        from toolgate.cli.main import main

        return main(["tools", "import-openapi", *args])

    def test_it_writes_one_loadable_file_per_operation_and_names_the_skipped(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        from toolgate.contracts.registry import load_tool_file

        spec = tmp_path / "shop.json"
        spec.write_text(json.dumps(SPEC_30))
        auth = tmp_path / "auth.yaml"
        auth.write_text("bearer_file: /run/secrets/shop\n")
        out = tmp_path / "out"
        code = self.run(str(spec), "--prefix", "shop", "--out", str(out), "--auth", str(auth))
        said = capsys.readouterr()
        assert code == 0, said.err
        assert sorted(Path(line).name for line in said.out.split()) == [
            "shop_cancel_order.yaml",
            "shop_get_order.yaml",
            "shop_head_orders_order_id.yaml",
            "shop_replace_order.yaml",
        ]
        loaded = load_tool_file(out / "shop_get_order.yaml")
        assert loaded.http is not None and loaded.http.auth is not None
        assert loaded.http.auth.bearer_file == "/run/secrets/shop"
        assert "# Left out: optional header parameter 'X-Trace'" in (
            (out / "shop_get_order.yaml").read_text()
        )
        assert "skipped GET /signed (signed): it needs the header parameter 'X-Sig'" in said.err
        assert "4 operation(s)" in said.err and "4 skipped" in said.err

    def test_bad_input_is_one_line_and_exit_2_and_nothing_importable_exit_1(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        swagger = tmp_path / "swagger.yaml"
        swagger.write_text("swagger: '2.0'\npaths: {}\n")
        out = tmp_path / "out"
        assert self.run(str(swagger), "--prefix", "s", "--out", str(out)) == 2
        assert self.run(str(tmp_path / "absent.yaml"), "--prefix", "s", "--out", str(out)) == 2
        assert self.run(str(swagger), "--prefix", "Bad-Prefix", "--out", str(out)) == 2
        bad_auth = tmp_path / "auth.yaml"
        bad_auth.write_text("bearer_file: /a\nbearer_env: B\n")
        spec = tmp_path / "shop.yaml"
        spec.write_text(yaml.safe_dump(SPEC_30))
        assert self.run(str(spec), "--prefix", "s", "--out", str(out), "--auth", str(bad_auth)) == 2
        nothing = copy.deepcopy(SPEC_30)
        nothing["paths"] = {"/signed": SPEC_30["paths"]["/signed"]}
        spec.write_text(yaml.safe_dump(nothing))
        assert self.run(str(spec), "--prefix", "s", "--out", str(out)) == 1
        lines = capsys.readouterr().err.strip().splitlines()
        assert "not an OpenAPI 3.0 or 3.1 document (swagger '2.0')" in lines[0]
        assert "cannot read" in lines[1] and "--prefix 'Bad-Prefix'" in lines[2]
        assert "exactly one of bearer_file" in lines[3]
        assert lines[-1].endswith("nothing written") and not out.exists()
