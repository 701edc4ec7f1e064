"""SQLiteCheckpointer: LangGraph checkpoints in one file, shared by savers and processes."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

# LangGraph is imported by the tests, not at collection (every xdist worker collects
# every test file).
if TYPE_CHECKING:
    from toolgate.client.frameworks.langgraph import SQLiteCheckpointer


class State(TypedDict, total=False):
    asked: str
    answer: Any


def ask(state: State) -> State:
    from langgraph.types import interrupt

    return {"answer": interrupt({"question": state["asked"]})}


def graph(checkpointer: SQLiteCheckpointer) -> Any:
    from langgraph.graph import START, StateGraph

    builder = StateGraph(State)
    builder.add_node("ask", ask)
    builder.add_edge(START, "ask")
    return builder.compile(checkpointer=checkpointer)


def config(thread: str) -> Any:
    return {"configurable": {"thread_id": thread}}


def test_a_graph_paused_with_one_saver_resumes_with_another_on_the_same_file(
    tmp_path: Path,
) -> None:
    from langgraph.types import Command

    from toolgate.client.frameworks.langgraph import SQLiteCheckpointer

    path = tmp_path / "graphs.sqlite"
    first = SQLiteCheckpointer(path)
    paused = graph(first).invoke({"asked": "approve?"}, config("t1"))
    assert paused["__interrupt__"][0].value == {"question": "approve?"}
    first.close()

    later = SQLiteCheckpointer(path)  # as a fresh process would open it
    done = graph(later).invoke(Command(resume="yes"), config("t1"))
    assert done == {"asked": "approve?", "answer": "yes"}
    assert len(list(later.list(config("t1")))) >= 2  # the history is there too
    later.close()


def test_two_savers_writing_one_file_lose_neither_thread(tmp_path: Path) -> None:
    from langgraph.types import Command

    from toolgate.client.frameworks.langgraph import SQLiteCheckpointer

    path = tmp_path / "graphs.sqlite"
    one, two = SQLiteCheckpointer(path), SQLiteCheckpointer(path)
    graph(one).invoke({"asked": "a"}, config("ta"))
    graph(two).invoke({"asked": "b"}, config("tb"))  # read-modify-write: keeps ta
    assert graph(one).invoke(Command(resume=1), config("ta"))["answer"] == 1
    assert graph(two).invoke(Command(resume=2), config("tb"))["answer"] == 2
    third = SQLiteCheckpointer(path)
    assert third.get_tuple(config("ta")) is not None and third.get_tuple(config("tb")) is not None
    third.delete_thread("ta")
    assert SQLiteCheckpointer(path).get_tuple(config("ta")) is None
    for saver in (one, two, third):
        saver.close()
