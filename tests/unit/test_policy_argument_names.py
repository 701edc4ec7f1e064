"""`policy check` refuses a rule on an argument no tool in its scope takes (argument_names.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from toolgate.contracts.registry import BUILTIN_TOOLS_DIR, Registry, load_registry
from toolgate.infra.examples import orders, refund
from toolgate.services.policy.argument_names import unknown_arguments

REGISTRY = load_registry(BUILTIN_TOOLS_DIR, refund.REGISTRY_DIR, orders.REGISTRY_DIR)


def rule(scope: str, when: str) -> str:
    """A forbid with this scope (after `principal, `) and `when` clause."""
    return f'@id("x")\nforbid (principal, {scope})\nwhen {{ {when} }};\n'


def unknown(policy: str, registry: Registry = REGISTRY) -> list[str]:
    return [str(found) for found in unknown_arguments({"p.cedar": policy}, registry)]


def test_a_misspelt_argument_of_the_scoped_tool_is_named_with_file_line_and_column() -> None:
    policy = (
        '@id("refund-limit")\n'
        'forbid (principal, action, resource == Tool::"refund_payment")\n'
        "when { context.arguments has amonut && context.arguments.amonut > 500 };\n"
    )
    assert unknown(policy) == [
        "p.cedar:3:30: policy 'refund-limit' reads context.arguments.amonut, which no tool "
        "it applies to takes (refund_payment takes amount, payment_id, reason)"
    ]
    assert unknown(policy.replace("amonut", "amount")) == []


def test_an_argument_of_another_tool_is_unknown_to_the_scoped_one() -> None:
    policy = rule('action, resource == Tool::"echo"', "context.arguments has amount")
    assert len(unknown(policy)) == 1 and "echo takes payload" in unknown(policy)[0]


def test_the_action_scopes_the_tools() -> None:
    # `url` is fetch_document's (a read); no tool that writes takes it
    writes = rule('action == Action::"write", resource', "context.arguments has url")
    assert "context.arguments.url" in unknown(writes)[0]
    reads = writes.replace('Action::"write"', 'Action::"read"')
    assert unknown(reads) == []
    every = writes.replace('== Action::"write"', 'in Action::"call"')
    assert unknown(every) == []


def test_a_resource_type_scopes_the_tools_that_act_on_it() -> None:
    policy = rule("action, resource is Order", "context.arguments has query")
    assert "context.arguments.query" in unknown(policy)[0]
    assert unknown(policy.replace("query", "order_id")) == []
    tasks = rule("action, resource is Task", "context.arguments has claim")
    assert unknown(tasks) == []  # save_evidence is task-scoped


def test_context_tool_in_a_when_clause_scopes_the_rule() -> None:
    policy = (
        '@id("x")\nforbid (principal, action, resource)\n'
        'when { context.tool == Tool::"search_sources" && context.arguments has url };'
    )
    assert "search_sources takes limit, query, source_type" in unknown(policy)[0]


def test_an_unscoped_rule_may_read_any_tools_argument() -> None:
    policy = rule(
        "action, resource", 'context.arguments has url || context.arguments["quuery"] == ""'
    )
    found = unknown(policy)
    assert len(found) == 1 and "context.arguments.quuery" in found[0]


def test_a_tool_that_takes_any_name_is_not_checked(tmp_path: Path) -> None:
    spec = yaml.safe_load((BUILTIN_TOOLS_DIR / "echo.yaml").read_text())
    spec["input_schema"].pop("additionalProperties")
    (tmp_path / "echo.yaml").write_text(yaml.safe_dump(spec))
    policy = rule('action, resource == Tool::"echo"', "context.arguments has anything")
    assert unknown(policy, load_registry(tmp_path)) == []


@pytest.mark.parametrize("name", ["refund_payment", "no_such_tool"])
def test_a_rule_for_a_tool_the_registry_lacks_is_not_checked(name: str) -> None:
    # one bundle for several gateways: this one does not know what the tool takes
    policy = rule(f'action, resource == Tool::"{name}"', "context.arguments has amonut")
    assert unknown(policy, load_registry(BUILTIN_TOOLS_DIR)) == []


def test_a_rule_for_no_tool_served_here_is_named_as_not_checked() -> None:
    """`policy check` from a folder where no `toolgate up` ran checks against the
    built-in tools: a typo in a rule for the operator's own tool passed in silence."""
    from toolgate.services.policy.argument_names import unchecked_policies

    policy = (
        '@id("tickets")\n'
        'forbid (principal, action, resource == Tool::"create_ticket")\n'
        'when { context.arguments has priorty && context.arguments.priorty == "high" };\n'
    )
    assert unknown(policy) == []  # by design: a rule for another gateway's tools
    assert unchecked_policies({"t.cedar": policy}, REGISTRY) == [("t.cedar", "tickets")]
    on_echo = rule('action, resource == Tool::"echo"', "context.arguments has payload")
    no_arguments = '@id("y")\nforbid (principal, action, resource == Tool::"create_ticket");\n'
    assert unchecked_policies({"e.cedar": on_echo, "n.cedar": no_arguments}, REGISTRY) == []
