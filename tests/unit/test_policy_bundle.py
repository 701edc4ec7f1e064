"""Loading policy bundles: versions, and bad files refused with file, line and reason."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from toolgate.cli.policy import cmd_check, cmd_push
from toolgate.services.policy.bundle import (
    DEFAULT_BUNDLE_DIR,
    SCHEMA_FILE,
    BundleError,
    build_bundle,
    bundle_version,
    load_bundle,
    read_bundle_dir,
)
from toolgate.services.policy.cedar_source import split_statements
from toolgate.services.policy.engine import engine_from_files

DEFAULT_FILES = read_bundle_dir(DEFAULT_BUNDLE_DIR)
SCHEMA = DEFAULT_FILES[SCHEMA_FILE]
GOOD = '@id("all")\npermit (principal, action, resource);\n'


def rejection(files: dict[str, str]) -> str:
    with pytest.raises(BundleError) as raised:
        engine_from_files(files)
    return str(raised.value)


class TestVersion:
    def test_default_bundle_loads_with_every_policy_named(self) -> None:
        bundle = load_bundle()
        assert set(bundle.policies) >= {
            "registered-tool",
            "allowed-agents",
            "task-scope",
            "tenant-isolation",
            "approval-critical",
        }
        assert bundle.policies["task-scope"].error_code == "TASK_SCOPE_VIOLATION"

    def test_version_is_the_content_hash_of_the_files(self) -> None:
        same = build_bundle(dict(DEFAULT_FILES))
        changed = build_bundle({**DEFAULT_FILES, "extra.cedar": GOOD})
        assert load_bundle().version == same.version == bundle_version(DEFAULT_FILES)
        assert changed.version != same.version

    def test_comment_change_is_a_new_version(self) -> None:
        first = build_bundle({SCHEMA_FILE: SCHEMA, "a.cedar": GOOD})
        second = build_bundle({SCHEMA_FILE: SCHEMA, "a.cedar": "// why\n" + GOOD})
        assert first.version != second.version


class TestRejection:
    def test_syntax_error_names_file_and_line(self) -> None:
        text = (
            '// header\n\n@id("ok")\npermit (principal, action, resource);\n\n'
            '@id("broken")\npermit (principal, action, resource)\n'
            'when { context.risk = "low" };\n'
        )
        message = rejection({SCHEMA_FILE: SCHEMA, "a.cedar": GOOD, "b.cedar": text})
        # the `=` itself: line 8 of b.cedar, column 21 (its policy starts on line 6)
        assert message.startswith("b.cedar:8:21: ") and "not a valid operator" in message

    def test_syntax_error_on_line_2_of_a_policy_names_line_2(self) -> None:
        text = (
            '@id("broken") permit (principal, action, resource)\nwhen { context.risk = "low" };\n'
        )
        message = rejection({SCHEMA_FILE: SCHEMA, "broken.cedar": text})
        assert message.startswith("broken.cedar:2:21: "), message

    def test_unexpected_token_names_its_line_and_column(self) -> None:
        text = '@id("broken")\npermit (principal,\n        action resource);\n'
        message = rejection({SCHEMA_FILE: SCHEMA, "broken.cedar": text})
        assert message.startswith("broken.cedar:3:16: ") and "`resource`" in message

    def test_a_string_that_never_ends_is_named_where_it_starts(self) -> None:
        text = (
            GOOD
            + '@id("broken")\npermit (principal, action, resource)\n'
            + '  when { context.risk == "l };\n'
        )
        message = rejection({SCHEMA_FILE: SCHEMA, "broken.cedar": text})
        assert message.startswith("broken.cedar:5:26: "), message

    def test_type_error_against_the_schema_names_file_and_line(self) -> None:
        text = (
            GOOD + '\n@id("typo")\nforbid (principal, action, resource)\n'
            'when { context.tool.riskk == "high" };\n'
        )
        message = rejection({SCHEMA_FILE: SCHEMA, "a.cedar": text})
        # where `riskk` is read (the policy starts on line 4)
        assert message.startswith("a.cedar:6:21: ") and "riskk" in message

    def test_policy_without_an_id_is_refused(self) -> None:
        message = rejection(
            {SCHEMA_FILE: SCHEMA, "a.cedar": GOOD + "\npermit (principal, action, resource);\n"}
        )
        assert message.startswith("a.cedar:4: ") and "@id" in message

    def test_id_used_in_two_files_is_refused(self) -> None:
        message = rejection({SCHEMA_FILE: SCHEMA, "a.cedar": GOOD, "b.cedar": GOOD})
        assert message.startswith("b.cedar:1: ") and "used twice" in message

    def test_approvers_on_a_permit_is_refused(self) -> None:
        message = rejection(
            {
                SCHEMA_FILE: SCHEMA,
                "a.cedar": '@id("x") @approvers("2")\npermit (principal, action, resource);',
            }
        )
        assert message.startswith("a.cedar:1: ") and "@approvers" in message

    def test_schema_error_names_the_schema_line(self) -> None:
        schema = SCHEMA.replace("entity Agent;", "entity Agent;\nentity Broken = { x: Strin };")
        line = schema.splitlines().index("entity Broken = { x: Strin };") + 1
        message = rejection({SCHEMA_FILE: schema, "a.cedar": GOOD})
        assert message.startswith(f"{SCHEMA_FILE}:{line}:22: ") and "Strin" in message

    def test_schema_that_does_not_describe_the_engines_requests_is_refused(self) -> None:
        schema = SCHEMA.replace("  any_agent: Bool,", "")
        message = rejection({SCHEMA_FILE: schema, "a.cedar": GOOD})
        assert "does not describe what the engine sends" in message

    def test_bundle_without_schema_or_policies_is_refused(self) -> None:
        assert "schema.cedarschema: missing" in rejection({"a.cedar": GOOD})
        assert "no policy file" in rejection({SCHEMA_FILE: SCHEMA})

    def test_bad_bundle_settings_are_refused(self) -> None:
        message = rejection(
            {SCHEMA_FILE: SCHEMA, "a.cedar": GOOD, "bundle.yaml": "approval_ttl_s: -1\n"}
        )
        assert message.startswith("bundle.yaml: ")


def policy_args(directory: Path, data_dir: Path, **more: object) -> argparse.Namespace:
    """What `toolgate policy check|push DIRECTORY --data-dir DATA_DIR` parses to."""
    return argparse.Namespace(
        directory=directory, data_dir=data_dir, registry=None, no_builtin_tools=False, **more
    )


class TestCheckCommand:
    def test_check_prints_the_version(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        assert cmd_check(policy_args(DEFAULT_BUNDLE_DIR, tmp_path)) == 0
        assert capsys.readouterr().out.startswith(bundle_version(DEFAULT_FILES))

    def test_check_refuses_a_bad_bundle_naming_file_and_line(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        (tmp_path / SCHEMA_FILE).write_text(SCHEMA)
        (tmp_path / "a.cedar").write_text(GOOD + "permit (principal, action resource);\n")
        assert cmd_check(policy_args(tmp_path, tmp_path)) == 2
        assert "a.cedar:3:27: " in capsys.readouterr().err

    def test_push_refuses_a_bad_bundle_before_connecting(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        (tmp_path / SCHEMA_FILE).write_text(SCHEMA)
        (tmp_path / "a.cedar").write_text("permit (principal, action, resource);\n")
        nowhere = "nats://127.0.0.1:1"  # nothing listens: a connection attempt would fail
        assert cmd_push(policy_args(tmp_path, tmp_path, nats_url=nowhere)) == 2
        assert "a.cedar:1: " in capsys.readouterr().err


def test_statements_split_at_semicolons_outside_strings_and_comments() -> None:
    text = '// a; comment\n@id("x;y")\npermit (principal, action, resource);\n\n  forbid;\n'
    assert [s.line for s in split_statements(text)] == [2, 5]
