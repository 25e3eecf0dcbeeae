"""Batch evaluation: task ids x rows (the rehearsal modes and the real best-of-K baseline) -> the table.

Every episode runs through the engine and is written by the store's Recorder exactly as a
UI run, so an eval can be browsed and annotated afterwards. An eval that stops resumes:
an episode whose (task, model, adapter, settings) the database already holds finished is
read back instead of run again (settings include mode, K, seed, selector and budgets).
All figures are computed from the Episode records, so they equal what the store holds.

`run_eval()` is what `python -m app eval` calls; `app.eval.report` renders its result.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Iterator

from app import envs
from app.config import DEFAULT_RELEVANCE
from app.divergence import aggregate, compare
from app.engine import EpisodeRunner
from app.engine.oracle import call_matches, oracle_settings
from app.envs.base import Task
from app.formats import REHEARSE_STOP, canonical_json, parse_result
from app.records import DEFAULT_REHEARSAL_CONTEXT, Episode, Metrics, RunSettings, utcnow
from app.store import Recorder, Store
from model_backend.base import Policy

log = logging.getLogger(__name__)

BEST_OF_K = "best-of-K"
"""Row key of the real best-of-K baseline (its label in tables: "real best-of-K")."""
FIDELITY = ("json_valid", "exact", "field_f1", "error_agree", "surprise")
PROBE_BATCH = 8
"""Rehearse prompts per batched pass in the state-snapshot probe."""


@dataclass
class EvalConfig:
    """One evaluation: which tasks, which rows, which model, and the engine's budgets."""

    task_ids: list[str]
    modes: list[str] = field(default_factory=lambda: ["none", "parallel", "sequential"])
    branches: int = 4
    """K: candidates (parallel, best-of-K) or attempts (sequential); mode none always uses 1."""
    best_of_k: bool = True
    """Add the real best-of-K row: the same K candidates executed on forks, the best by outcome committed."""
    seed: int = 0
    model: str = "embedded"
    adapter: str | None = None
    selector: str = "judge"
    temperature: float = 0.8
    shadow: bool = True
    rehearsal_context: str = DEFAULT_REHEARSAL_CONTEXT
    tool_choice: str = "auto"
    """`required` prefills `<tool_call>`: every step calls a tool (helps small base models)."""
    proposal: str = "sample"
    """How the K candidates differ (RunSettings.proposal)."""
    relevance: float = DEFAULT_RELEVANCE
    """Weight of the noisy-channel score in the tool ranking (RunSettings.relevance)."""
    constrain: bool = True
    """Schema-constrained Act and Rehearse decoding (RunSettings.constrain)."""
    max_steps_per_turn: int | None = None
    max_turns: int | None = None
    """Judge only the first N user turns of each task (None: all); cuts CPU time on long tasks."""
    max_action_tokens: int = 96
    max_rehearsal_tokens: int = 128
    memory: str = "off"
    """Real transitions the Rehearse prompts retrieve (RunSettings.memory; off by default, as measured there);
    with `seed` or `online` the evaluated task's scenario is never retrieved from another episode."""
    memory_k: int = 3
    keep_primary: bool = True
    """RunSettings.keep_primary: a selector moves the commit off the greedy primary only on a predicted error."""
    state_probe: int = 32
    """Committed/shadow calls re-rehearsed with and without the state snapshot (0: skip the probe)."""

    def row_settings(self) -> dict[str, RunSettings]:
        """Row key -> RunSettings, in table order (validates like the CLI's `run`)."""
        base = dict(seed=self.seed, temperature=self.temperature, selector=self.selector, shadow=self.shadow,
                    rehearsal_context=self.rehearsal_context, tool_choice=self.tool_choice, proposal=self.proposal,
                    relevance=self.relevance, constrain=self.constrain, memory=self.memory, memory_k=self.memory_k,
                    keep_primary=self.keep_primary,
                    max_steps_per_turn=self.max_steps_per_turn,
                    max_action_tokens=self.max_action_tokens, max_rehearsal_tokens=self.max_rehearsal_tokens)
        rows = {mode: RunSettings(mode=mode, branches=1 if mode == "none" else self.branches, **base)
                for mode in self.modes}
        if self.best_of_k:
            rows[BEST_OF_K] = oracle_settings(RunSettings(branches=self.branches, **base))
        return rows


@dataclass
class EvalProgress:
    """One progress event: a step finished (`kind="step"`) or an episode was run or resumed."""

    kind: str
    """`step`, `episode` (just run) or `resumed` (read back from the database)."""
    done: int
    """Episodes done so far (run or resumed)."""
    total: int
    row: str
    task_id: str
    episode_id: str
    steps: int = 0


ProgressCallback = Callable[[EvalProgress], None]


# ---------------------------------------------------------------- running


def resolve_tasks(spec: str, split: str | None = None, limit: int | None = None) -> list[str]:
    """Task ids from a comma list of categories (`multi_turn_base`, `bfcl:multi_turn_base`), groups
    (`mcp:git`: every task of that MCP server; `mcp`: all of them; `tau2:airline`, `tau2`) and ids.

    `split` keeps the ids of one split (`train`, `heldout`; multi_turn_base and tau2 are split);
    `limit` keeps the first N. Raises ValueError (UnknownTaskError included) with a one-line
    message for unknown ids or categories, an empty selection, or a limit under 1.
    """
    if limit is not None and limit < 1:
        raise ValueError(f"--limit must be at least 1, got {limit}")
    items = [item.strip() for item in spec.split(",") if item.strip()]
    if not items:
        raise ValueError("no task given: --tasks takes a category or a comma list of task ids")
    ids: list[str] = []
    for item in items:
        group = envs.task_group(item, split)  # e.g. mcp:git (every task of that server), tau2:airline
        if group is not None:
            ids += group
            continue
        category = item.split(":", 1)[1] if item.startswith("bfcl:") else item
        if category in envs.CATEGORIES:
            found = envs.list_tasks(category, split)
            if not found:
                raise ValueError(f"the {split} split of {category} is empty")
            ids += found
            continue
        task = envs.load_task(item)
        if split is not None and task.extra.get("split") != split:
            raise ValueError(f"task {task.id} is not in the {split} split")
        ids.append(task.id)
    ids = list(dict.fromkeys(ids))
    return ids[:limit] if limit is not None else ids




def episode_complete(status: str, judged_turns: int, max_turns: int | None) -> bool:
    """Finished, or stopped after the `max_turns` turns this eval judges."""
    return status == "finished" or (max_turns is not None and status == "stopped" and judged_turns >= max_turns)


def find_complete_episode(store: Store, task_id: str, settings: RunSettings, model: str,
                          adapter: str | None, max_turns: int | None) -> str | None:
    """The newest stored episode with these task, model, adapter and settings that is complete."""
    for row in store.list_episodes(task_id=task_id, model=model, mode=settings.mode, seed=settings.seed):
        if row["adapter"] != adapter or RunSettings.from_stored(json.loads(row["settings"])) != settings:
            continue
        if episode_complete(row["status"], len(json.loads(row["turn_results"] or "[]")), max_turns):
            return row["id"]
    return None


def run_episode(task: Task, policy: Any, settings: RunSettings, store: Store, *, model: str,
                adapter: str | None, max_turns: int | None = None,
                on_step: Callable[[Episode], None] | None = None, memory: Any = None) -> Episode:
    """Run one episode to its end (or `max_turns` turns), writing every step through a Recorder. `memory`
    (a `RehearsalMemory`) is retrieved from without the task's own transitions of other episodes.

    On KeyboardInterrupt the episode is marked stopped and flushed, then the interrupt goes on.
    """
    recorder = Recorder(store)

    def record(ep: Episode, step: Any) -> None:
        recorder(ep, step)
        if on_step is not None:
            on_step(ep)

    runner = EpisodeRunner(task, policy, settings, model=model, adapter=adapter, on_step=record, memory=memory,
                           exclude_own_task=True)
    recorder.start(runner.episode)
    try:
        while not runner.done and (max_turns is None or runner.turn < max_turns):
            runner.step()
    finally:
        runner.stop()  # no-op when finished; a cut-off or interrupted episode is marked stopped
        recorder.flush(runner.episode)
    return runner.episode


def run_eval(cfg: EvalConfig, store: Store, policy: Any | Callable[[], Any], *,
             progress: ProgressCallback | None = None) -> dict[str, Any]:
    """Run (or resume) every (row, task) episode, then compute the table and the breakdowns.

    `policy` is a Policy or a zero-argument factory, called only when an episode must run
    (a fully resumed eval without the probe loads no model).
    """
    rows = cfg.row_settings()
    tasks = {task_id: envs.load_task(task_id) for task_id in cfg.task_ids}
    total = len(rows) * len(tasks)
    loaded: list[Any] = []

    def get_policy() -> Any:
        if not loaded:
            loaded.append(policy if isinstance(policy, Policy) else policy())
        return loaded[0]

    from app.training.memory_seed import open_memory

    memory = open_memory(store, seed=cfg.memory != "off")
    memory_before = memory.counts()
    started = time.perf_counter()
    by_row: dict[str, list[Episode]] = {}
    ran = resumed = 0
    for row, settings in rows.items():
        by_row[row] = []
        for task_id, task in tasks.items():
            found = find_complete_episode(store, task_id, settings, cfg.model, cfg.adapter, cfg.max_turns)
            if found is not None:
                ep, kind = store.get_episode(found), "resumed"
                resumed += 1
            else:
                def on_step(ep: Episode, row: str = row, task_id: str = task_id) -> None:
                    if progress is not None:
                        progress(EvalProgress("step", ran + resumed, total, row, task_id, ep.id, len(ep.steps)))
                ep, kind = run_episode(task, get_policy(), settings, store, model=cfg.model, adapter=cfg.adapter,
                                       max_turns=cfg.max_turns, on_step=on_step, memory=memory), "episode"
                ran += 1
            by_row[row].append(truncate(ep, cfg.max_turns))
            if progress is not None:
                progress(EvalProgress(kind, ran + resumed, total, row, task_id, ep.id, len(ep.steps)))
    episodes = [ep for eps in by_row.values() for ep in eps]
    probe = (state_context_probe(get_policy(), episodes, tasks, cfg.state_probe, cfg.max_rehearsal_tokens, cfg.seed)
             if cfg.state_probe > 0 else None)
    result = {
        "config": asdict(cfg),
        "tasks": list(tasks),
        "rows": [{"row": row, "settings": rows[row].model_dump(), **table_row(eps, tasks)}
                 for row, eps in by_row.items()],
        "fidelity": {"by_tool": fidelity_by(episodes, lambda b, t: b.call.name if b.call else None, tasks),
                     "by_access": fidelity_by(episodes, access_of, tasks),
                     "by_context": probe},
        "memory": {"mode": cfg.memory, "k": cfg.memory_k, "transitions_at_start": memory_before,
                   "transitions_at_end": memory.counts()},
        "constraints": loaded[0].constraint_note if loaded else "",
        "run": {"episodes_run": ran, "episodes_resumed": resumed,
                "seconds": round(time.perf_counter() - started, 1), "finished_at": utcnow()},
    }
    return result


def truncate(ep: Episode, max_turns: int | None) -> Episode:
    """The episode as this eval judges it: its first `max_turns` judged turns, counters recomputed."""
    if max_turns is None or ep.status == "finished" and len(ep.turn_results) <= max_turns:
        return ep
    judged = min(max_turns, len(ep.turn_results))
    steps = [s for s in ep.steps if s.turn < judged]
    results = ep.turn_results[:judged]
    return ep.model_copy(update={
        "steps": steps, "turn_results": results,
        "success": all(t.success for t in results) if results else None,
        "external_calls": sum(s.external_calls for s in steps),
        "shadow_calls": sum(s.shadow_calls for s in steps),
        "rehearsals": sum(s.rehearsals for s in steps)})


# ---------------------------------------------------------------- metrics


class _TaskInfo:
    """Per-task lookups the metrics need: ground truth, parameter names, which tools are read-only."""

    def __init__(self, task: Task) -> None:
        self.task = task
        env = envs.make_env(task)
        self.param_names = env.param_names
        env.set_turn(len(task.turns))  # every tool that appears in some turn (miss_func)
        self.read_only = {t.name: t.read_only for t in env.tools()}

    def gold(self, turn: int) -> list[str]:
        truth = self.task.ground_truth or []
        return truth[turn] if turn < len(truth) else []


def _infos(episodes: Iterable[Episode], tasks: dict[str, Task] | None = None) -> dict[str, _TaskInfo]:
    infos: dict[str, _TaskInfo] = {}
    for ep in episodes:
        if ep.task_id not in infos:
            task = (tasks or {}).get(ep.task_id) or envs.load_task(ep.task_id)
            infos[ep.task_id] = _TaskInfo(task)
    return infos


def _judged_gold_steps(ep: Episode, info: _TaskInfo) -> Iterator[tuple[Any, list[str]]]:
    """(step, gold calls) for steps in judged turns that have ground truth: call accuracy's denominator."""
    for step in ep.steps:
        if step.turn >= len(ep.turn_results):
            continue  # a turn cut short is not judged
        gold = info.gold(step.turn)
        if gold:
            yield step, gold


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 4) if b else None


def episode_metrics(episodes: list[Episode], tasks: dict[str, Task] | None = None) -> dict[str, Any]:
    """Call accuracy, call rate, turn success and rehearsal fidelity from finished episodes.

    Call accuracy: committed steps whose call equals one of the turn's ground-truth calls,
    over committed steps in judged turns that have ground truth; fidelity here counts the
    branches of those steps (kept as `training.agent` has always reported it).
    """
    infos = _infos(episodes, tasks)
    steps = matched = calls = parse_errors = turns = passed = 0
    measured: list[Metrics] = []
    for ep in episodes:
        turns += len(ep.turn_results)
        passed += sum(t.success for t in ep.turn_results)
        info = infos[ep.task_id]
        for step, gold in _judged_gold_steps(ep, info):
            steps += 1
            chosen = step.chosen_branch
            calls += chosen.kind == "call"
            parse_errors += chosen.kind == "parse_error"
            matched += call_matches(chosen.call, gold, info.param_names)
            measured += [b.metrics for b in step.branches if b.metrics.json_valid is not None]
    rehearsal = aggregate(measured)
    return {"episodes": len(episodes), "steps": steps, "call_accuracy": _ratio(matched, steps),
            "call_rate": _ratio(calls, steps), "parse_error_rate": _ratio(parse_errors, steps), "turns": turns, "turn_success": _ratio(passed, turns),
            "rehearsal": {k: rehearsal[k] for k in ("n", "exact", "field_f1", "error_agree", "json_valid")}}


def table_row(episodes: list[Episode], tasks: dict[str, Task] | None = None) -> dict[str, Any]:
    """One row of the table from a row's episodes (one per task).

    Fidelity here averages every branch with both a prediction and an actual response
    (committed and shadow), in every turn; per-task figures are means over episodes.
    """
    n = len(episodes)
    judged = [ep for ep in episodes if ep.turn_results]
    base = episode_metrics(episodes, tasks)
    fidelity = aggregate(b.metrics for ep in episodes for s in ep.steps for b in s.branches
                         if b.metrics.json_valid is not None)
    wall = sum(s.duration_s for ep in episodes for s in ep.steps)
    return {
        "episodes": [ep.id for ep in episodes],
        "n_tasks": n,
        "task_success": _ratio(sum(bool(ep.success) for ep in judged), len(judged)),
        "turn_success": base.get("turn_success"),
        "call_accuracy": base.get("call_accuracy"),
        "external_calls_per_task": _ratio(sum(ep.external_calls for ep in episodes), n),
        "rehearsals_per_task": _ratio(sum(ep.rehearsals for ep in episodes), n),
        "shadow_calls_per_task": _ratio(sum(ep.shadow_calls for ep in episodes), n),
        "steps_per_task": _ratio(sum(len(ep.steps) for ep in episodes), n),
        "fidelity_n": fidelity["n"],
        **{name: fidelity[name] for name in FIDELITY},
        "wall_s": round(wall, 1),
        "wall_s_per_task": _ratio(wall, n),
    }


def access_of(branch: Any, info: _TaskInfo) -> str | None:
    if branch.call is None:
        return None
    read_only = info.read_only.get(branch.call.name)
    return "unknown tool" if read_only is None else ("read-only" if read_only else "state-changing")


def fidelity_by(episodes: list[Episode], key: Callable[[Any, _TaskInfo], str | None],
                tasks: dict[str, Task] | None = None) -> dict[str, dict[str, Any]]:
    """Fidelity aggregated by `key(branch, task info)` over every measured branch of `episodes`."""
    infos = _infos(episodes, tasks)
    groups: dict[str, list[Metrics]] = {}
    for ep in episodes:
        for step in ep.steps:
            for b in step.branches:
                if b.metrics.json_valid is None:
                    continue
                name = key(b, infos[ep.task_id])
                if name is not None:
                    groups.setdefault(name, []).append(b.metrics)
    return {name: aggregate(groups[name]) for name in sorted(groups, key=lambda g: (-len(groups[g]), g))}


# ---------------------------------------------------------------- state-snapshot probe


def state_context_probe(policy: Any, episodes: list[Episode], tasks: dict[str, Task], max_calls: int,
                        max_tokens: int = 128, seed: int = 0) -> dict[str, Any]:
    """Fidelity with and without the environment-state snapshot, paired on the same calls.

    The first `max_calls` distinct (history, call) pairs with a real response, from the
    episodes in order, are rehearsed twice: with the history alone and with the history
    plus the state before the step (the runner's two `rehearsal_context` settings).
    """
    from app.engine.replay import replay
    from model_backend.base import GenerationConfig

    items: list[tuple[Any, Any, Any]] = []  # (view, call, actual)
    seen: set[str] = set()
    for ep in episodes:
        if len(items) >= max_calls:
            break
        for view in replay(ep, tasks.get(ep.task_id) or envs.load_task(ep.task_id)):
            for b in view.step.branches:
                if b.kind != "call" or b.call is None or b.actual_source is None or len(items) >= max_calls:
                    continue
                key = canonical_json([view.rehearse_prompt(b.call).messages, b.actual])
                if key not in seen:
                    seen.add(key)
                    items.append((view, b.call, b.actual))
    config = GenerationConfig(max_new_tokens=max_tokens, temperature=0.0, seed=seed, stop=REHEARSE_STOP)
    out: dict[str, Any] = {"calls": len(items)}
    for context in ("history", "history+state"):
        prompts = [view.rehearse_prompt(call, context) for view, call, _ in items]
        metrics: list[Metrics] = []
        for i in range(0, len(prompts), PROBE_BATCH):
            for gen, (_, _, actual) in zip(policy.rehearse(prompts[i:i + PROBE_BATCH], config),
                                           items[i:i + PROBE_BATCH]):
                predicted, error = parse_result(gen.text)
                metrics.append(compare(predicted, error is None, actual))
        out[context] = aggregate(metrics)
    return out


__all__ = ["BEST_OF_K", "access_of", "EvalConfig", "EvalProgress", "call_matches", "episode_complete", "episode_metrics",
           "fidelity_by", "find_complete_episode", "resolve_tasks", "run_episode", "run_eval", "state_context_probe",
           "table_row", "truncate"]
