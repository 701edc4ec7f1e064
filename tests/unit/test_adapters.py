"""Provider adapters: real SDK objects in, toolgate contracts out, and back."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import msgspec
import pytest
from pydantic import TypeAdapter

from toolgate.client.adapters import (
    PROVIDER_CALL_ID_KEY,
    AdapterError,
    InvalidToolCallArguments,
    from_anthropic,
    from_openai_chat,
    from_openai_responses,
    parse_arguments,
    provider_id_map,
    safe_call_id,
    to_anthropic,
    to_openai_chat,
    to_openai_responses,
)
from toolgate.contracts.calls import (
    ErrorCode,
    PendingNotice,
    Principal,
    ToolCall,
    ToolResult,
    is_valid_call_id,
    success,
)

# The SDKs' types are imported in the tests that build or check them, not at collection:
# every xdist worker collects every test file, and anthropic + openai cost ~1 CPU-s each.
if TYPE_CHECKING:
    from anthropic.types import Message, ToolUseBlock
    from openai.types.chat import ChatCompletionMessage, ChatCompletionMessageFunctionToolCall
    from openai.types.responses import (
        Response,
        ResponseFunctionToolCall,
        ResponseOutputMessage,
    )

PRINCIPAL = Principal(tenant="acme", user="u-1", agent="researcher", session="s-1")


# ---------------------------------------------------------------------------
# builders of real SDK objects


def chat_message(*tool_calls: Any, content: str | None = None) -> ChatCompletionMessage:
    from openai.types.chat import ChatCompletionMessage

    return ChatCompletionMessage(
        role="assistant", content=content, tool_calls=list(tool_calls) or None
    )


def chat_call(call_id: str, name: str, arguments: str) -> ChatCompletionMessageFunctionToolCall:
    from openai.types.chat import ChatCompletionMessageFunctionToolCall
    from openai.types.chat.chat_completion_message_function_tool_call import Function

    return ChatCompletionMessageFunctionToolCall(
        id=call_id, type="function", function=Function(name=name, arguments=arguments)
    )


def responses_call(call_id: str, name: str, arguments: str) -> ResponseFunctionToolCall:
    from openai.types.responses import ResponseFunctionToolCall

    return ResponseFunctionToolCall(
        type="function_call",
        call_id=call_id,
        name=name,
        arguments=arguments,
        id=f"fc_{call_id}",
        status="completed",
    )


def response(*output: Any) -> Response:
    from openai.types.responses import Response

    return Response(
        id="resp_1",
        created_at=0.0,
        model="gpt-test",
        object="response",
        output=list(output),
        parallel_tool_calls=True,
        tool_choice="auto",
        tools=[],
    )


def output_message(text: str) -> ResponseOutputMessage:
    from openai.types.responses import ResponseOutputMessage, ResponseOutputText

    return ResponseOutputMessage(
        id="msg_1",
        role="assistant",
        status="completed",
        type="message",
        content=[ResponseOutputText(type="output_text", text=text, annotations=[])],
    )


def anthropic_message(*content: Any) -> Message:
    from anthropic.types import Message, Usage

    return Message(
        id="msg_01",
        type="message",
        role="assistant",
        model="claude-test",
        content=list(content),
        stop_reason="tool_use",
        stop_sequence=None,
        usage=Usage(input_tokens=1, output_tokens=1),
    )


def tool_use(block_id: str, name: str, input: dict[str, Any]) -> ToolUseBlock:
    from anthropic.types import ToolUseBlock

    return ToolUseBlock(type="tool_use", id=block_id, name=name, input=input)


def assert_typed_dict_shape(value: dict[str, Any], typed_dict: Any) -> None:
    """`value` has every key the SDK requires, none it does not know, and validates."""
    assert typed_dict.__required_keys__ <= value.keys()
    assert value.keys() <= typed_dict.__annotations__.keys()
    TypeAdapter(typed_dict).validate_python(value)


def only_calls(items: list[ToolCall | ToolResult]) -> list[ToolCall]:
    assert all(isinstance(item, ToolCall) for item in items), items
    return list(items)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------
# OpenAI Chat Completions


def test_chat_message_with_several_tool_calls_maps_to_one_tool_call_each_in_order():
    message = chat_message(
        chat_call("call_abc123", "search_sources", '{"query": "tides", "limit": 3}'),
        chat_call("call_def456", "fetch_document", '{"source_id": "doc-7"}'),
        content="Let me look that up.",
    )

    calls = only_calls(
        from_openai_chat(message, principal=PRINCIPAL, task_id="t-9", context={"trace": "tr-1"})
    )

    assert [c.call_id for c in calls] == ["call_abc123", "call_def456"]
    assert [c.tool for c in calls] == ["search_sources", "fetch_document"]
    assert calls[0].arguments == {"query": "tides", "limit": 3}
    assert calls[1].arguments == {"source_id": "doc-7"}
    assert all(c.principal == PRINCIPAL and c.task_id == "t-9" for c in calls)
    assert all(c.context == {"trace": "tr-1"} for c in calls)


def test_chat_tool_calls_list_and_plain_dicts_are_accepted_like_the_message():
    message = chat_message(chat_call("call_1", "echo", '{"text": "hi"}'))

    from_message = from_openai_chat(message, principal=PRINCIPAL)
    from_list = from_openai_chat(message.tool_calls, principal=PRINCIPAL)
    from_dict = from_openai_chat(message.model_dump(), principal=PRINCIPAL)
    from_dict_list = from_openai_chat(message.model_dump()["tool_calls"], principal=PRINCIPAL)

    assert from_message == from_list == from_dict == from_dict_list
    assert from_message[0] == ToolCall(
        call_id="call_1", tool="echo", arguments={"text": "hi"}, principal=PRINCIPAL
    )


def test_chat_message_without_tool_calls_maps_to_nothing():
    assert from_openai_chat(chat_message(content="Just text."), principal=PRINCIPAL) == []


@pytest.mark.parametrize(
    ("arguments", "reason"),
    [
        ('{"query": "tides"', "not valid JSON"),
        ("not json at all", "not valid JSON"),
        ('["a", "b"]', "got array"),
        ('"a string"', "got string"),
        ("null", "got null"),
        ('{"x": NaN}', "not valid JSON"),
    ],
)
def test_chat_call_with_malformed_arguments_becomes_immediate_invalid_arguments_result(
    arguments, reason
):
    message = chat_message(
        chat_call("call_good", "echo", '{"text": "hi"}'),
        chat_call("call_bad", "search_sources", arguments),
    )

    good, bad = from_openai_chat(message, principal=PRINCIPAL)

    assert isinstance(good, ToolCall) and good.call_id == "call_good"
    assert isinstance(bad, ToolResult)
    assert bad.call_id == "call_bad"
    assert bad.ok is False and bad.status == "invalid_arguments" and bad.data is None
    assert bad.error is not None and bad.error.code == ErrorCode.MALFORMED_CALL
    assert reason in bad.error.message
    assert bad.error.retryable is False


def test_chat_rejection_is_answered_to_the_model_under_the_same_tool_call_id():
    message = chat_message(chat_call("call_bad", "echo", "{oops"))

    [rejection] = from_openai_chat(message, principal=PRINCIPAL)
    reply = to_openai_chat(rejection)

    assert reply["tool_call_id"] == "call_bad"
    assert json.loads(reply["content"])["error"]["code"] == "MALFORMED_CALL"


def test_chat_call_with_empty_arguments_string_means_no_arguments():
    [call] = from_openai_chat(
        chat_message(chat_call("call_1", "list_things", "")), principal=PRINCIPAL
    )

    assert isinstance(call, ToolCall) and call.arguments == {}


def test_chat_custom_tool_call_is_rejected_immediately_rather_than_dropped():
    from openai.types.chat import ChatCompletionMessageCustomToolCall
    from openai.types.chat.chat_completion_message_custom_tool_call import Custom

    custom = ChatCompletionMessageCustomToolCall(
        id="call_custom", type="custom", custom=Custom(name="grammar", input="free text")
    )
    message = chat_message(chat_call("call_fn", "echo", "{}"), custom)

    fn, rejected = from_openai_chat(message, principal=PRINCIPAL)

    assert isinstance(fn, ToolCall)
    assert isinstance(rejected, ToolResult) and rejected.call_id == "call_custom"
    assert rejected.status == "invalid_arguments" and "custom" in rejected.error.message


def test_chat_tool_call_without_id_is_an_adapter_error_not_a_rejection():
    with pytest.raises(AdapterError):
        from_openai_chat(
            [{"type": "function", "function": {"name": "echo", "arguments": "{}"}}],
            principal=PRINCIPAL,
        )


def test_to_openai_chat_builds_a_valid_tool_message_carrying_the_whole_result():
    from openai.types.chat import ChatCompletionToolMessageParam

    result = success("call_abc123", {"hits": [{"id": "doc-7"}]})

    reply = to_openai_chat(result)

    assert reply["role"] == "tool"
    assert reply["tool_call_id"] == "call_abc123"
    assert json.loads(reply["content"]) == {
        "call_id": "call_abc123",
        "ok": True,
        "status": "ok",
        "data": {"hits": [{"id": "doc-7"}]},
        "error": None,
    }
    assert_typed_dict_shape(reply, ChatCompletionToolMessageParam)
    assert msgspec.json.decode(reply["content"], type=ToolResult) == result


def test_chat_round_trip_yields_a_conversation_the_sdk_accepts():
    from openai.types.chat import ChatCompletionMessageParam

    assistant = chat_message(
        chat_call("call_1", "echo", '{"text": "a"}'),
        chat_call("call_2", "echo", '{"text": "b"}'),
    )
    calls = only_calls(from_openai_chat(assistant, principal=PRINCIPAL))
    replies = [to_openai_chat(success(c.call_id, c.arguments)) for c in calls]

    conversation = [
        {"role": "user", "content": "echo a and b"},
        assistant.model_dump(exclude_none=True),
        *replies,
    ]

    TypeAdapter(list[ChatCompletionMessageParam]).validate_python(conversation)
    assert [r["tool_call_id"] for r in replies] == [tc.id for tc in assistant.tool_calls]


# ---------------------------------------------------------------------------
# OpenAI Responses


def test_responses_output_function_calls_map_in_order_and_other_items_are_skipped():
    from openai.types.responses import ResponseReasoningItem

    resp = response(
        ResponseReasoningItem(id="rs_1", type="reasoning", summary=[]),
        output_message("Looking it up."),
        responses_call("call_r1", "search_sources", '{"query": "tides"}'),
        responses_call("call_r2", "fetch_document", '{"source_id": "doc-7"}'),
    )

    calls = only_calls(from_openai_responses(resp.output, principal=PRINCIPAL, task_id="t-1"))

    assert [(c.call_id, c.tool, c.arguments) for c in calls] == [
        ("call_r1", "search_sources", {"query": "tides"}),
        ("call_r2", "fetch_document", {"source_id": "doc-7"}),
    ]
    assert all(c.task_id == "t-1" for c in calls)
    assert from_openai_responses(resp, principal=PRINCIPAL, task_id="t-1") == calls
    assert (
        from_openai_responses(resp.model_dump()["output"], principal=PRINCIPAL, task_id="t-1")
        == calls
    )


def test_responses_call_id_not_item_id_becomes_the_toolgate_call_id():
    [call] = from_openai_responses([responses_call("call_r1", "echo", "{}")], principal=PRINCIPAL)

    assert call.call_id == "call_r1"  # the item's id is "fc_call_r1": not what the reply must name


def test_responses_malformed_arguments_become_immediate_invalid_arguments_result():
    good, bad = from_openai_responses(
        [
            responses_call("call_ok", "echo", '{"text": "x"}'),
            responses_call("call_bad", "echo", "[1, 2"),
        ],
        principal=PRINCIPAL,
    )

    assert isinstance(good, ToolCall)
    assert isinstance(bad, ToolResult) and bad.call_id == "call_bad"
    assert bad.status == "invalid_arguments" and bad.error.code == ErrorCode.MALFORMED_CALL


def test_to_openai_responses_builds_a_valid_function_call_output_item():
    from openai.types.responses import ResponseInputItemParam
    from openai.types.responses.response_input_item_param import FunctionCallOutput

    result = success("call_r1", {"text": "x"})

    item = to_openai_responses(result)

    assert item["type"] == "function_call_output"
    assert item["call_id"] == "call_r1"
    assert msgspec.json.decode(item["output"], type=ToolResult) == result
    assert_typed_dict_shape(item, FunctionCallOutput)
    TypeAdapter(list[ResponseInputItemParam]).validate_python([item])


# ---------------------------------------------------------------------------
# Anthropic Messages


def test_anthropic_tool_use_blocks_map_to_tool_calls_and_text_blocks_are_skipped():
    from anthropic.types import TextBlock, ThinkingBlock

    message = anthropic_message(
        ThinkingBlock(type="thinking", thinking="need two tools", signature="sig"),
        TextBlock(type="text", text="I'll search, then save."),
        tool_use("toolu_01A09q90qw90lq917835lq9", "search_sources", {"query": "tides"}),
        TextBlock(type="text", text="And save it."),
        tool_use("toolu_01B", "save_evidence", {"note": "n", "source_id": "doc-7"}),
    )

    calls = only_calls(from_anthropic(message, principal=PRINCIPAL, context={"trace": "tr"}))

    assert [(c.call_id, c.tool, c.arguments) for c in calls] == [
        ("toolu_01A09q90qw90lq917835lq9", "search_sources", {"query": "tides"}),
        ("toolu_01B", "save_evidence", {"note": "n", "source_id": "doc-7"}),
    ]
    assert all(c.context == {"trace": "tr"} for c in calls)
    assert from_anthropic(message.content, principal=PRINCIPAL, context={"trace": "tr"}) == calls
    assert (
        from_anthropic(message.model_dump(), principal=PRINCIPAL, context={"trace": "tr"}) == calls
    )


def test_anthropic_tool_use_with_non_object_input_becomes_immediate_rejection():
    [rejection] = from_anthropic(
        [{"type": "tool_use", "id": "toolu_1", "name": "echo", "input": '{"text": "x"}'}],
        principal=PRINCIPAL,
    )

    assert isinstance(rejection, ToolResult) and rejection.call_id == "toolu_1"
    assert (
        rejection.status == "invalid_arguments" and rejection.error.code == ErrorCode.MALFORMED_CALL
    )


def test_to_anthropic_builds_a_valid_tool_result_block_flagging_errors():
    from anthropic.types import ToolResultBlockParam

    ok_block = to_anthropic(success("toolu_01B", {"saved": True}))
    [rejection] = from_anthropic(
        [{"type": "tool_use", "id": "toolu_01C", "name": "", "input": {}}], principal=PRINCIPAL
    )
    error_block = to_anthropic(rejection)

    assert ok_block == {
        "type": "tool_result",
        "tool_use_id": "toolu_01B",
        "content": ok_block["content"],
        "is_error": False,
    }
    assert json.loads(ok_block["content"])["data"] == {"saved": True}
    assert error_block["is_error"] is True and error_block["tool_use_id"] == "toolu_01C"
    for block in (ok_block, error_block):
        assert_typed_dict_shape(block, ToolResultBlockParam)


def test_anthropic_round_trip_yields_a_user_turn_the_sdk_accepts():
    from anthropic.types import MessageParam, TextBlock, ToolResultBlockParam

    assistant = anthropic_message(
        TextBlock(type="text", text="Two calls."),
        tool_use("toolu_1", "echo", {"text": "a"}),
        tool_use("toolu_2", "echo", {"text": "b"}),
    )
    calls = only_calls(from_anthropic(assistant, principal=PRINCIPAL))
    user_turn = {
        "role": "user",
        "content": [to_anthropic(success(c.call_id, c.arguments)) for c in calls],
    }

    TypeAdapter(list[MessageParam]).validate_python(
        [
            {
                "role": "assistant",
                "content": [b.model_dump(exclude_none=True) for b in assistant.content],
            },
            user_turn,
        ]
    )
    # MessageParam.content is an Iterable, which pydantic does not look inside: check each block.
    for block in user_turn["content"]:
        assert_typed_dict_shape(block, ToolResultBlockParam)
    assert [b["tool_use_id"] for b in user_turn["content"]] == ["toolu_1", "toolu_2"]


# ---------------------------------------------------------------------------
# provider call ids


UNSAFE_IDS = ["call.with.dots", "tool:use/1", "id with spaces", "é-unicode", "a" * 129]


@pytest.mark.parametrize("provider_id", UNSAFE_IDS)
def test_unsafe_provider_id_maps_to_a_deterministic_subject_safe_call_id(provider_id):
    call_id = safe_call_id(provider_id)

    assert is_valid_call_id(call_id)
    assert call_id != provider_id
    assert call_id == safe_call_id(provider_id)


def test_distinct_unsafe_provider_ids_map_to_distinct_call_ids():
    assert len({safe_call_id(p) for p in UNSAFE_IDS}) == len(UNSAFE_IDS)


@pytest.mark.parametrize(
    "provider_id", ["call_abc123", "toolu_01A09q90qw90lq917835lq9", "a" * 128, "x-1"]
)
def test_safe_provider_id_is_used_unchanged_and_not_recorded(provider_id):
    [call] = from_openai_chat([chat_call(provider_id, "echo", "{}")], principal=PRINCIPAL)

    assert call.call_id == provider_id
    assert PROVIDER_CALL_ID_KEY not in call.context


def test_unsafe_chat_id_is_mapped_kept_in_context_and_restored_in_the_reply():
    provider_id = "chatcmpl.tool.0"
    [call] = from_openai_chat(
        chat_message(chat_call(provider_id, "echo", '{"text": "x"}')), principal=PRINCIPAL
    )

    assert is_valid_call_id(call.call_id)
    assert call.context[PROVIDER_CALL_ID_KEY] == provider_id

    ids = provider_id_map([call])
    reply = to_openai_chat(success(call.call_id, "x"), provider_call_id=ids[call.call_id])

    assert reply["tool_call_id"] == provider_id
    assert json.loads(reply["content"])["call_id"] == call.call_id


def test_unsafe_responses_and_anthropic_ids_are_restored_in_their_replies():
    [r_call] = from_openai_responses([responses_call("fc/1", "echo", "{}")], principal=PRINCIPAL)
    [a_call] = from_anthropic([tool_use("toolu:1", "echo", {})], principal=PRINCIPAL)

    r_reply = to_openai_responses(
        success(r_call.call_id, None), provider_call_id=provider_id_map([r_call])[r_call.call_id]
    )
    a_reply = to_anthropic(
        success(a_call.call_id, None), provider_call_id=provider_id_map([a_call])[a_call.call_id]
    )

    assert r_reply["call_id"] == "fc/1"
    assert a_reply["tool_use_id"] == "toolu:1"


def test_provider_id_map_covers_calls_and_rejections_of_a_from_result():
    items = from_openai_chat(
        [
            chat_call("call_safe", "echo", "{}"),
            chat_call("unsafe.ok", "echo", "{}"),
            chat_call("unsafe.bad", "echo", "{broken"),
        ],
        principal=PRINCIPAL,
    )

    ids = provider_id_map(items)

    assert isinstance(items[2], ToolResult)
    assert sorted(ids.values()) == ["call_safe", "unsafe.bad", "unsafe.ok"]
    replies = [
        to_openai_chat(item, provider_call_id=ids[item.call_id])
        for item in items
        if isinstance(item, ToolResult)
    ]
    assert [r["tool_call_id"] for r in replies] == ["unsafe.bad"]


def test_provider_id_map_of_a_rebuilt_call_list_reads_context():
    [call] = from_anthropic([tool_use("toolu.9", "echo", {})], principal=PRINCIPAL)
    rebuilt = msgspec.json.decode(
        msgspec.json.encode(call), type=ToolCall
    )  # e.g. after a hop over the wire

    assert provider_id_map([rebuilt]) == {call.call_id: "toolu.9"}


def test_provider_id_map_of_a_safe_id_is_the_identity():
    assert provider_id_map([success("call_1", None)]) == {"call_1": "call_1"}


# ---------------------------------------------------------------------------
# argument parsing helper


def test_parse_arguments_raises_typed_error_naming_the_call():
    with pytest.raises(InvalidToolCallArguments) as info:
        parse_arguments("call_1", "{nope")

    assert info.value.call_id == "call_1"
    assert "not valid JSON" in info.value.message


def test_parse_arguments_accepts_an_already_parsed_object():
    assert parse_arguments("call_1", {"a": 1}) == {"a": 1}


# ---------------------------------------------------------------------------
# a call waiting for a human (DESIGN invariant 13)


def test_a_call_waiting_for_a_human_is_an_error_answer_in_every_provider_shape():
    """A platform told `on_pending` may answer the model before a human decided: every
    `to_*` then says the tool has not run, as an error, never as a success."""
    from anthropic.types import ToolResultBlockParam
    from openai.types.chat import ChatCompletionToolMessageParam
    from openai.types.responses.response_input_item_param import FunctionCallOutput

    notice = PendingNotice(
        call_id="toolu_01P",
        message="waiting for 1 human approval(s) of this high-risk call",
        expires_at="2026-12-01T09:00:00+00:00",
    )
    chat = to_openai_chat(notice)
    responses = to_openai_responses(notice, provider_call_id="call_orig")
    block = to_anthropic(notice)
    assert block["is_error"] is True and block["tool_use_id"] == "toolu_01P"
    assert responses["call_id"] == "call_orig"
    for content in (chat["content"], responses["output"], block["content"]):
        seen = json.loads(content)
        assert seen["ok"] is False and seen["status"] == "approval_pending"
        assert seen["data"] is None and seen["error"]["code"] == ErrorCode.APPROVAL_REQUIRED
        assert "the tool has not run" in seen["error"]["message"]
        assert "toolu_01P" in seen["error"]["message"]
    assert_typed_dict_shape(chat, ChatCompletionToolMessageParam)
    assert_typed_dict_shape(responses, FunctionCallOutput)
    assert_typed_dict_shape(block, ToolResultBlockParam)
