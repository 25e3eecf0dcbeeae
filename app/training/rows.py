"""Act and Rehearse training rows from traces: expert replays, self-training episodes, corrections.

Every row's prompt is built by the engine's own functions (`act_prompt`, `history.rehearse_step_prompt`)
over a history rebuilt by the engine's own rule (`app.engine.replay.replay`), so a model trains on
the very prompts it later sees. Expert traces are recorded as ordinary `Episode`s (the
ground-truth calls executed in the real environment by `app.engine.replay.replay_ground_truth`), so one
replay serves all sources.
"""
from __future__ import annotations

import json
import logging
import random
import zlib
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Iterator

from app import envs
from app.engine.history import call_required
from app.engine.memory import MemoryScope, observed
from app.engine.replay import GoldCall, StepView, replay, replay_ground_truth
from app.envs.base import Task, ToolResult
from app.envs.bfcl_tasks import SINGLE_TURN_CATEGORIES, single_turn_examples
from app.formats import (TOOL_CALL_OPEN, HistoryItem, act_prompt, call_text, cut, in_schema_order, parse_action,
                         rehearse_target)
from app.records import Annotation, Branch, Call, Episode, MemoryHit, RunSettings, Step, TurnResult, utcnow
from model_backend.base import Prompt
from model_backend.training import TrainRow

log = logging.getLogger(__name__)

CountTokens = Callable[[str], int]
FINAL_ANSWER = "Done: I have completed your request."
"""The expert's reply at a turn's end with nothing to report (every call returned nothing). BFCL judges state and
results, not this text; the row teaches the agent to stop calling tools once the request is done."""
ANSWER_CHARS = 220
"""The longest expert answer (about 60 tokens, inside `RunSettings.max_action_tokens`)."""
EXPERT_MODEL = "expert"


class CorrectionError(ValueError):
    """An annotation that cannot become a training row (the message names it)."""


@dataclass
class PromptContext:
    """What prompt rendering needs from the model: the same values the runner passes."""

    count_tokens: CountTokens
    context_window: int
    settings: RunSettings = field(default_factory=RunSettings)
    memory: Any = None
    """A `RehearsalMemory`: Rehearse rows carry what it retrieves for their call (never their own task's
    transitions but those observed earlier in the same episode), as the rehearser's prompts do."""
    memory_k: int = 0
    memory_share: float = 1.0
    """The share of Rehearse rows given memory (the rest keep the prompt without it, so both work)."""
    state_share: float | None = None
    """None: each Rehearse row shows what its episode's rehearsal context showed (the prompt the rehearser saw).
    A share: that share of rows shows the state before the call (`history+state`, where the step recorded one),
    a fixed draw per row, and the rest the history alone, so a model learns both."""


# ---------------------------------------------------------------- expert traces


def expert_episode(task: Task, explore: int = 0, pool: dict[str, list[dict[str, Any]]] | None = None,
                   seed: int = 0) -> Episode:
    """The ground-truth calls of `task` executed in a real environment, recorded as an Episode.

    Each turn ends with a plain-text answer built from the turn's real results (`final_answer`). Turns are
    checked by the task's judge, so the episode says whether the replay really succeeded. `explore` (with an
    argument `pool`, `memory_seed.argument_pool`): that many calls sampled on forks before each gold call
    (`memory_seed.explore_calls`), kept as unchosen branches with their real responses (`actual_source`
    "shadow"): Rehearse rows of calls an agent might make, errors included. The draw is fixed per task and `seed`.
    """
    from app.training.memory_seed import explore_calls

    if not task.ground_truth:
        raise ValueError(f"task {task.id} has no ground truth")
    env, judge = envs.make_env(task), envs.make_judge(task)
    rng = random.Random(f"{seed}:{task.id}")
    settings = RunSettings(mode="none", branches=1, shadow=False)
    ep = Episode(id=f"expert-{task.id}", task_id=task.id, model=EXPERT_MODEL, settings=settings)
    explored: list[Branch] = []

    def before(gold: GoldCall) -> None:
        explored.clear()
        for e in explore_calls(env, gold, pool or {}, rng, explore) if explore else []:
            call = Call(name=e.name, arguments=in_schema_order(e.arguments, e.tool))
            if call_text(call) in {call_text(gold.call)} | {b.action_text for b in explored}:
                continue  # the gold call is a row already; a repeated draw is one
            explored.append(Branch(index=len(explored) + 1, action_text=call_text(call), kind="call", call=call,
                                   actual=e.result.output, actual_error=e.result.error, actual_source="shadow"))

    for turn, calls in enumerate(task.ground_truth):
        executed, golds = [], []
        for gold in replay_ground_truth(task, env, turn, states=True, before=before):
            # The call in schema order: what the constrained Act writes (BFCL's strings sometimes differ).
            branch = Branch(index=0, action_text=call_text(gold.call), kind="call", call=gold.call,
                            actual=gold.result.output, actual_error=gold.result.error, actual_source="committed",
                            chosen=True)
            ep.steps.append(Step(index=len(ep.steps), turn=turn, branches=[branch, *explored], chosen=0, kind="call",
                                 state_before=gold.state_before, state_after=gold.state_after, external_calls=1,
                                 shadow_calls=len(explored)))
            executed.append((gold.name, gold.arguments, gold.result.output))
            golds.append(gold)
        answer = Branch(index=0, action_text=final_answer(golds), kind="answer", chosen=True)
        state = env.state()
        ep.steps.append(Step(index=len(ep.steps), turn=turn, branches=[answer], chosen=0, kind="answer",
                             state_before=state, state_after=state))
        check = judge.check_turn(turn, env, executed)
        ep.turn_results.append(TurnResult(turn=turn, success=check.success, state_ok=check.state_ok,
                                          response_ok=check.response_ok, steps=len(calls) + 1))
    ep.status, ep.finished_at = "finished", utcnow()
    ep.success = all(t.success for t in ep.turn_results)
    ep.external_calls = sum(s.external_calls for s in ep.steps)
    ep.shadow_calls = sum(s.shadow_calls for s in ep.steps)
    return ep


def _flat(value: Any) -> str:
    """A result value as a person reads it: strings bare, lists comma-separated, objects as `key: value`."""
    if value in ("", [], {}, None):
        return "none"
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        return ", ".join(f"{k}: {_flat(v)}" for k, v in value.items())
    if isinstance(value, list):
        return ", ".join(_flat(v) for v in value)
    return json.dumps(value, ensure_ascii=False, default=str)


def final_answer(calls: Iterable[GoldCall]) -> str:
    """The expert's reply at a turn's end, built from the turn's real results (kept under `ANSWER_CHARS`): what the
    read-only calls found ("Done. wc returned count: 9, type: words."), else what the last call that answered
    something said, else `FINAL_ANSWER`. A person reads what the agent concluded; a question gets its data."""
    done = [g for g in calls if g.result is not None and g.result.output not in (None, {}, [], "")]
    read = [g for g in done if g.tool is not None and g.tool.read_only]
    shown = read or done[-1:]
    if not shown:
        return FINAL_ANSWER
    parts = [f"{g.name} {'failed: ' if g.result.error else 'returned '}{_flat(g.result.output)}" for g in shown]
    text = "Done. " + "; ".join(parts)
    return cut(text, ANSWER_CHARS) if len(text) >= ANSWER_CHARS else text.rstrip(".") + "."


def answer_values(calls: Iterable[GoldCall]) -> list[str]:
    """The data a turn's read-only calls returned, as text an answer that reports it contains: every number, and
    every string of 3 characters or more (its first 24), from successful read-only results."""
    out: list[str] = []

    def leaves(value: Any) -> None:
        if isinstance(value, dict):
            for v in value.values():
                leaves(v)
        elif isinstance(value, list):
            for v in value:
                leaves(v)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out.append(str(value))
        elif isinstance(value, str) and len(value.strip()) >= 3:
            out.append(value.strip()[:24])

    for g in calls:
        if g.tool is not None and g.tool.read_only and g.result is not None and not g.result.error:
            leaves(g.result.output)
    return out


def as_gold(view: StepView) -> GoldCall | None:
    """A replayed step's committed call with its real result, as `final_answer` and `answer_values` read calls (None
    for a step that committed no call)."""
    b = view.step.chosen_branch
    if b.kind != "call" or b.call is None or b.actual_source is None:
        return None
    return GoldCall(turn=view.step.turn, tools=view.tools, name=b.call.name, arguments=b.call.arguments, call=b.call,
                    result=ToolResult(b.actual, error=bool(b.actual_error)))


def turn_ends(episode: Episode, task: Task) -> Iterator[tuple[StepView, list[str]]]:
    """Each answer step of a replayed episode, with the data its turn's committed read-only calls returned
    (`answer_values`; empty: not a question turn)."""
    calls: list[GoldCall] = []
    for view in replay(episode, task):
        gold = as_gold(view)
        if gold is not None:
            calls.append(gold)
        elif view.step.chosen_branch.kind == "answer":
            yield view, answer_values([g for g in calls if g.turn == view.step.turn])


def mentions(answer: str, values: list[str]) -> bool:
    """Whether `answer` carries any of `values` (case-insensitive)."""
    low = answer.lower()
    return any(v.lower() in low for v in values)


# ---------------------------------------------------------------- rows


def act_row_prompt(view: StepView, ctx: PromptContext) -> Prompt:
    s = ctx.settings
    prefill = TOOL_CALL_OPEN if call_required(s.tool_choice, view.history) else ""
    return act_prompt(view.tools, view.history, ctx.count_tokens, ctx.context_window,
                      reserve=s.max_action_tokens + 32, prefill=prefill, constrain=s.constrain)


def act_target(branch: Branch, prefill: str = "") -> str | None:
    """What the Act role should write for a branch (after any prefill); None when unusable."""
    if branch.kind == "call" and branch.call is not None:
        text = call_text(branch.call)
    elif branch.kind == "answer" and branch.action_text.strip():
        text = branch.action_text.strip()
    else:
        return None
    if prefill:
        if not text.startswith(prefill):
            return None  # a plain answer cannot follow a forced `<tool_call>`
        text = text[len(prefill):]
    return text


def episode_rows(episode: Episode, task: Task, ctx: PromptContext, *, source: str,
                 turns: set[int] | None = None, rehearse_all_turns: bool = True) -> list[TrainRow]:
    """Act rows for the committed branches (of `turns`, default all) and Rehearse rows for
    every branch that has a real response (committed or shadow).

    Real responses are right whatever the turn's outcome, so `rehearse_all_turns` keeps
    Rehearse rows from turns outside `turns` too.
    """
    rows: list[TrainRow] = []
    settings = ctx.settings.model_copy(update={"tool_choice": episode.settings.tool_choice})
    ctx = replace(ctx, settings=settings)
    recent: list[Any] = []  # real transitions observed earlier in the episode (what its rehearsals may see)
    for view in replay(episode, task):
        step = view.step
        ref = f"{episode.id}/{step.index}"
        in_turns = turns is None or step.turn in turns
        if in_turns:
            prompt = act_row_prompt(view, ctx)
            target = act_target(step.chosen_branch, prompt.prefill)
            if target is not None:
                rows.append(TrainRow("act", prompt, target, source, f"{ref}/{step.chosen}"))
        for b in step.branches if in_turns or rehearse_all_turns else []:
            if b.kind == "call" and b.call is not None and b.actual_source is not None:
                examples = _row_memory(ctx, episode, b, recent, f"{ref}/{b.index}")
                # An expert episode's unchosen branches are its explored calls (`expert_episode(explore=)`).
                row_source = "explore" if source == "expert" and not b.chosen else source
                rows.append(TrainRow("rehearse", view.rehearse_prompt(b.call, _row_context(ctx, episode, step,
                                                                                           f"{ref}/{b.index}"),
                                                                      episode.settings.constrain, examples),
                                     rehearse_target(b.actual), row_source, f"{ref}/{b.index}"))
        if ctx.memory is not None:
            recent += observed(step, task_id=episode.task_id, split=task.extra.get("split"), episode_id=episode.id,
                               tools={t.name: t for t in view.tools})
    return rows


def _row_context(ctx: PromptContext, episode: Episode, step: Step, ref: str) -> str:
    """A Rehearse row's context: the episode's, or with a `state_share` `history+state` for that share of rows (a
    fixed draw per row) whose step recorded its state and `history` for the rest."""
    if ctx.state_share is None:
        return episode.settings.rehearsal_context
    drawn = zlib.crc32(b"state:" + ref.encode()) % 1000 < ctx.state_share * 1000
    return "history+state" if drawn and step.state_before is not None else "history"


def _row_memory(ctx: PromptContext, episode: Episode, branch: Branch, recent: list[Any], ref: str) -> list[MemoryHit]:
    """What a Rehearse row's prompt retrieves: what the branch was shown when it ran (`Branch.memory`), else
    the memory's hits for its call, never its own task's but for the episode's earlier calls."""
    if ctx.memory is None or ctx.memory_k <= 0 or zlib.crc32(ref.encode()) % 1000 >= ctx.memory_share * 1000:
        return []
    if branch.memory:
        return list(branch.memory)
    scope = MemoryScope("seed", task_id=episode.task_id, episode_id=episode.id, exclude_task=True)
    return ctx.memory.retrieve(branch.call, scope, ctx.memory_k, recent)


def expert_rows(task_ids: Iterable[str], ctx: PromptContext, explore: int = 0,
                seed: int = 0) -> tuple[list[TrainRow], list[Episode]]:
    """Rows from the expert replays of `task_ids` (only turns the judge passed). `explore`: calls explored on forks
    before each gold call (argument sets from these tasks' ground truth), Rehearse rows with source `explore`."""
    from app.training.memory_seed import argument_pool

    task_ids = list(task_ids)
    pool = argument_pool(task_ids) if explore else None
    rows: list[TrainRow] = []
    episodes = []
    for task_id in task_ids:
        task = envs.load_task(task_id)
        ep = expert_episode(task, explore, pool, seed)
        ok = {t.turn for t in ep.turn_results if t.success}
        if len(ok) < len(ep.turn_results):
            log.warning("expert replay of %s failed turns %s; skipping them", task_id,
                        sorted({t.turn for t in ep.turn_results} - ok))
        rows += episode_rows(ep, task, ctx, source="expert", turns=ok, rehearse_all_turns=False)
        episodes.append(ep)
    return rows, episodes


def self_training_rows(episodes: Iterable[Episode], ctx: PromptContext) -> list[TrainRow]:
    """Reward-filtered rows: Act rows of turns that passed the judge; Rehearse rows of every real response.

    Real responses are the committed calls and every shadow execution on a fork (writes
    included where the environment forks); each gets the Rehearse prompt of its step.
    """
    rows: list[TrainRow] = []
    for ep in episodes:
        task = envs.load_task(ep.task_id)
        ok = {t.turn for t in ep.turn_results if t.success}
        rows += episode_rows(ep, task, ctx, source="self", turns=ok, rehearse_all_turns=True)
    return rows


def single_turn_rows(ctx: PromptContext, categories: Iterable[str] = SINGLE_TURN_CATEGORIES) -> list[TrainRow]:
    """Act rows of BFCL's single-turn tool selection (`bfcl_tasks.single_turn_examples`): the Act prompt
    over the entry's functions and its one user message -> the expected call.

    New requests and new functions (the multi-turn training split repeats its 150 scenarios, and
    BFCL's other multi-turn categories repeat the same questions index for index): rows that teach
    picking a tool from its description. No Rehearse rows: nothing here is executed.
    """
    rows = []
    for category in categories:
        for ex in single_turn_examples(category):
            history = [HistoryItem(role="user", content=ex.request)]
            s = ctx.settings
            prefill = TOOL_CALL_OPEN if call_required(s.tool_choice, history) else ""
            prompt = act_prompt(list(ex.tools), history, ctx.count_tokens, ctx.context_window,
                                reserve=s.max_action_tokens + 32, prefill=prefill, constrain=s.constrain)
            text = call_text(Call(name=ex.name, arguments=ex.arguments))
            rows.append(TrainRow("act", prompt, text[len(prefill):], "single_turn", f"bfcl:{ex.id}"))
    return rows


# ---------------------------------------------------------------- corrections


def parse_corrected_value(annotation: Annotation, annotation_id: Any) -> Any:
    """The corrected response: the JSON value the annotation holds, as is (a string is the JSON string it is,
    `""` included; the forms parse what a person types before it is saved)."""
    if not annotation.corrected_predicted_set:
        raise CorrectionError(f"annotation {annotation_id}: it has no corrected response")
    return annotation.corrected_predicted


def parse_corrected_action(annotation: Annotation, annotation_id: Any) -> Branch:
    """The corrected action as a branch: a plain answer when the person marked it as one, else a tool call (one
    saved before the kind was recorded is read as it parses)."""
    text = (annotation.corrected_action or "").strip()
    if annotation.corrected_action_kind == "answer":
        if not text:
            raise CorrectionError(f"annotation {annotation_id}: the corrected answer is empty")
        return Branch(index=0, action_text=text, kind="answer")
    parsed = parse_action(text)
    if parsed.kind == "parse_error":
        raise CorrectionError(f"annotation {annotation_id}: the corrected action is not a valid tool call "
                              f"or answer ({parsed.error})")
    if annotation.corrected_action_kind == "call" and parsed.kind != "call":
        raise CorrectionError(f"annotation {annotation_id}: the corrected action is marked as a tool call but is "
                              "plain text")
    return Branch(index=0, action_text=text, kind=parsed.kind, call=parsed.call)


def correction_rows(episode: Episode, task: Task, corrections: dict[tuple[int, int], tuple[Any, Annotation]],
                    ctx: PromptContext, env: Any = None, notes: list[str] | None = None) -> list[TrainRow]:
    """Rows from annotated branches: corrected_action -> Act target, corrected_predicted -> Rehearse target.

    `corrections` maps (step index, branch index) to (annotation id, annotation); `env`: as `replay`'s. A
    correction that cannot become a row (a plain answer where the episode forced tool calls, a corrected response
    with no call to rehearse) is left out with a line in `notes` (raised when `notes` is None).
    """
    rows: list[TrainRow] = []
    settings = ctx.settings.model_copy(update={"tool_choice": episode.settings.tool_choice})
    ctx = replace(ctx, settings=settings)

    def left_out(message: str) -> None:
        if notes is None:
            raise CorrectionError(message)
        notes.append(message)

    for view in replay(episode, task, env):
        for b in view.step.branches:
            found = corrections.get((view.step.index, b.index))
            if found is None:
                continue
            ann_id, ann = found
            ref = f"{episode.id}/{view.step.index}/{b.index}#annotation{ann_id}"
            if ann.corrected_action is not None and ann.corrected_action.strip():
                prompt = act_row_prompt(view, ctx)
                target = act_target(parse_corrected_action(ann, ann_id), prompt.prefill)
                if target is None:
                    left_out(f"annotation {ann_id}: the corrected action must be a tool call "
                             "(the episode forced tool calls); its Act row is left out")
                else:
                    rows.append(TrainRow("act", prompt, target, "correction", ref))
            if ann.corrected_predicted_set:
                value = parse_corrected_value(ann, ann_id)
                call = b.call
                if call is None and ann.corrected_action:
                    call = parse_corrected_action(ann, ann_id).call
                if call is None:
                    left_out(f"annotation {ann_id}: a corrected response needs a branch with a tool call; "
                             "its Rehearse row is left out")
                    continue
                rows.append(TrainRow("rehearse", view.rehearse_prompt(call, episode.settings.rehearsal_context,
                                                                      episode.settings.constrain),
                                     rehearse_target(value), "correction", ref))
    return rows


__all__ = [
    "ANSWER_CHARS", "CorrectionError", "EXPERT_MODEL", "FINAL_ANSWER", "PromptContext", "act_row_prompt", "act_target",
    "answer_values", "as_gold", "final_answer", "mentions", "turn_ends",
    "correction_rows", "episode_rows", "expert_episode", "expert_rows", "self_training_rows", "single_turn_rows",
]
