"""The conversation the Act role reads: what a turn's opening and a committed branch add to it.

One owner for the rule, used by the live runner (`EpisodeRunner`) and by the replay that
rebuilds the history of a recorded episode for training rows (`training.rows.replay`), so a
model trains on exactly the history it acts on.
"""
from __future__ import annotations

from typing import Iterable

from app.envs import Task
from app.formats import HistoryItem, call_text
from app.records import Branch, TurnResult

TYPED_USER_MESSAGE = "typed_user_message"
"""The key of a verdict's details that keeps a user turn a person typed (`EpisodeRunner.add_user_turn`)."""


def turn_messages(task: Task, turn: int) -> list[HistoryItem]:
    """The turn's user messages; BFCL's miss_func writes an empty turn for "new tools arrived, carry
    on", whose text is the task's `additional_function_prompt`."""
    messages = task.turns[turn] if turn < len(task.turns) else []
    if not messages and task.extra.get("additional_function_prompt"):
        messages = [{"role": "user", "content": task.extra["additional_function_prompt"]}]
    return [HistoryItem(role="user", content=m["content"], turn=turn) for m in messages]


def with_typed_turns(turns: list[list[dict[str, str]]],
                     results: Iterable[TurnResult]) -> tuple[list[list[dict[str, str]]], dict[int, str]]:
    """A recorded episode's user turns: the task's scripted ones, with the turns a person typed (kept in
    the verdicts) in place of a scripted turn or after the last. Also returns the typed texts by turn."""
    typed = {r.turn: r.details[TYPED_USER_MESSAGE] for r in results if r.details.get(TYPED_USER_MESSAGE)}
    out = [list(t) for t in turns]
    for turn, text in sorted(typed.items()):
        message = [{"role": "user", "content": text}]
        if turn < len(out):
            out[turn] = message
        else:
            out.append(message)
    return out, typed


def committed_messages(branch: Branch, turn: int) -> list[HistoryItem]:
    """What a committed branch adds, its `actual` already set: an answer is one assistant message; a
    call (or an unparseable one, answered with the parse error) is the assistant's text and the tool's result."""
    if branch.kind == "answer":
        return [HistoryItem(role="assistant", content=branch.action_text.strip(), turn=turn)]
    if branch.kind == "call" and branch.call is not None:
        said = HistoryItem(role="assistant", content=call_text(branch.call), call=branch.call, turn=turn)
    else:
        said = HistoryItem(role="assistant", content=branch.action_text.strip(), turn=turn)
    return [said, HistoryItem(role="tool", content="", result=branch.actual, turn=turn)]


def call_required(tool_choice: str, history: list[HistoryItem]) -> bool:
    """Whether this step must call a tool: always under `required`; under `first`, when the last
    message is the user's (the first step of a turn, or after a typed user turn)."""
    if tool_choice == "required":
        return True
    return tool_choice == "first" and bool(history) and history[-1].role == "user"


def latest_request(history: list[HistoryItem]) -> str:
    """The last user message: the request the judge weighs a branch against."""
    users = [h.content for h in history if h.role == "user"]
    return users[-1] if users else ""
