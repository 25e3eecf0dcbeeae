"""What the two roles read: the conversation a turn's opening and a committed branch add to it, and what a
Rehearse prompt shows besides (`rehearse_step_prompt`: the pre-step state under `history+state`).

One owner for each rule, used by the live runner (`EpisodeRunner`, its `ModelRehearser`) and by the replay that
rebuilds the history of a recorded episode (`engine.replay.replay`: training rows, the eval's probe, the offline
rehearsal), so a model trains on exactly the prompts it acts and rehearses on.
"""
from __future__ import annotations

from typing import Any, Iterable, Sequence

from app.envs import Task
from app.envs.base import Tool
from app.formats import HistoryItem, call_text, rehearse_prompt
from app.records import Branch, Call, MemoryHit, TurnResult
from model_backend.base import Prompt

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


def rehearse_step_prompt(tool: Tool | None, call: Call, history: list[HistoryItem], state_before: Any,
                         rehearsal_context: str, *, constrain: bool = False,
                         examples: Sequence[MemoryHit] = ()) -> Prompt:
    """The Rehearse prompt of `call` at a step: the history before the step, the state before it only under
    `rehearsal_context="history+state"` (rehearsal comes before the commit), `examples` (retrieved real
    transitions), the call. The live rehearser and the replayed steps of training rows and the eval build
    theirs here."""
    state = state_before if rehearsal_context == "history+state" else None
    return rehearse_prompt(tool, call, history, state, constrain=constrain, examples=examples)


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
