"""The shipped agent: expert rows -> joint training -> reward-filtered self-training -> adapter.

`train_agent()` is what `python -m app train-agent` runs (about 35 minutes on 2 cores, its 8-task held-out table included):
1. expert traces: the ground-truth calls of the BFCL `multi_turn_base` training split,
   executed in the real classes (Act targets: the calls; Rehearse targets: real responses);
2. joint LoRA training on them;
3. at least one self-training round: roll out with parallel rehearsal on training tasks,
   keep the Act rows of turns the judge passed (and every real response as Rehearse rows),
   retrain on those plus a replay of expert rows;
4. save the adapter atomically with a model card, and compare base and adapter on
   held-out tasks (`heldout_report`).
"""
from __future__ import annotations

import json
import logging
import platform
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from tqdm.auto import tqdm

from app import envs
from app.config import DEFAULT_RELEVANCE, SHIPPED_ADAPTER, shipped_adapter
from app.divergence import aggregate, compare, looping
from app.engine.replay import replay, tool_named
from app.eval.evaluation import access_of, call_matches, episode_metrics, fidelity_by
from app.formats import REHEARSE_STOP, parse_result
from app.records import Episode, RunSettings, Transition
from app.training.rows import PromptContext, expert_episode, expert_rows, self_training_rows, single_turn_rows

log = logging.getLogger(__name__)

ADAPTER_NAME = SHIPPED_ADAPTER.name
Report = Callable[[str], None]


def default_adapter_path() -> Path | None:
    """The shipped adapter directory when it exists (the `embedded` spec's default adapter)."""
    return SHIPPED_ADAPTER if shipped_adapter() is not None else None


@dataclass
class AgentTrainingConfig:
    """What `train-agent` does; the defaults built the shipped adapter in 35 minutes on 2 idle cores
    (29.7 of training and rollouts, the rest the 8-task held-out base-vs-adapter table)."""

    out: Path = SHIPPED_ADAPTER
    spec: str = "embedded"
    seed: int = 0
    train_tasks: int | None = None
    """Use the first N training tasks for expert rows (None: all 150)."""
    parent: Path | None = None
    """Continue this adapter (a warm start: its rounds are not redone) instead of a new LoRA."""
    rehearse_rows: int | None = 220
    """Expert Rehearse rows sampled for round 1 (None: all 852; ~3 s each at ~500 tokens)."""
    rehearse_categories: tuple[str, ...] = ("multi_turn_base",)
    """BFCL categories whose training split (index mod 4 != 3) gives expert Rehearse rows (Act rows come from
    `multi_turn_base` only: the other categories' turns ask the agent to notice a missing tool or argument)."""
    act_rows: int | None = None
    """Expert Act rows sampled for round 1 (None: all)."""
    act_tasks: int | None = None
    """Instead of `act_rows`: every Act row of this many sampled training tasks, in episode order, so that a
    task's steps pack into shared sequences (a turn's calls and its closing answer cost about one row) and every
    turn end's answer (`rows.final_answer`) is in. None: as `act_rows`."""
    memory_k: int = 0
    """Transitions retrieved into each Rehearse row's prompt from the rehearsal memory's seed (never the row's
    own task's but its episode's earlier calls), as the rehearser does at run time; 0: no memory in rows."""
    memory_share: float = 0.8
    """With `memory_k`: the share of Rehearse rows given memory (the others keep the plain prompt)."""
    state_share: float | None = None
    """The share of Rehearse rows whose prompt shows the state before the call (`history+state`, the tool's own
    class's state); the others show the history alone, so the adapter serves both contexts (the state candidate:
    0.75). None: each row as its episode's rehearsal context."""
    explore: int = 0
    """Calls explored on forks before each expert call (`expert_episode(explore=)`: a sampled call of the same tool
    or another, arguments from the training split's ground truth), each a Rehearse row of its real response, errors
    included (source `explore`); 0: none, the shipped adapter's recipe."""
    explore_rows: int | None = None
    """With `explore`: the explored Rehearse rows sampled into round 1 (None: all)."""
    single_turn_rows: int = 0
    """Act rows from BFCL single-turn tool selection (`rows.single_turn_rows`, 1,205 in all) sampled into
    round 1 (0: none, the shipped adapter's recipe; -1: all)."""
    round1_steps: int = 400
    """About one pass over the 370 round-1 sequences (Act packs plus single Rehearse rows)."""
    round1_minutes: float = 26.0
    rollout_tasks: int = 8
    rollout_turns: int = 2
    """Turns rolled out per task: early turns have short prompts and clean state."""
    rollout_branches: int = 2
    """K of the rollouts' parallel rehearsal (constrained decoding, shadow execution on forks)."""
    rollout_minutes: float = 6.0
    """Per self-training round."""
    self_rounds: int = 1
    """Reward-filtered self-training rounds, each a rollout on fresh tasks and a training round."""
    round2_steps: int = 120
    round2_minutes: float = 5.0
    """Steps and minutes of each self-training round."""
    expert_replay_rows: int = 60
    """Expert rows mixed into round 2 so self-training does not forget the expert data."""
    eval_tasks: int = 8
    eval_turns: int = 2
    eval_forced_calls: int = 40
    eval_minutes: float = 8.0
    """Wall-time cap of each model's held-out episodes (the forced rehearsal comes on top)."""
    max_seq_len: int = 1600
    """Single rows over this are dropped (the p90 of expert Act prompts is ~1,600 tokens)."""
    pack_len: int = 2400
    rank: int = 16
    lr: float = 3e-4


@dataclass
class RoundSummary:
    name: str
    rows: dict[str, int]
    train: dict[str, Any]
    extra: dict[str, Any] = field(default_factory=dict)


def act_rows_of_tasks(act: list[Any], n: int, rng: random.Random) -> list[Any]:
    """Every Act row of `n` episodes drawn at random, in their order (a row's `ref` starts with its episode's id)."""
    episodes = sorted({row.ref.split("/", 1)[0] for row in act})
    drawn = set(rng.sample(episodes, min(n, len(episodes))))
    return [row for row in act if row.ref.split("/", 1)[0] in drawn]


# ---------------------------------------------------------------- evaluation


def rollout_settings(seed: int = 0, branches: int = 2) -> RunSettings:
    """Parallel rehearsal, K=2, logprob selector: the cheapest setting that still rehearses every call.
    Constrained decoding (the default) and shadow execution: every non-chosen call also runs on a
    fork, so each rollout step yields up to K real (call, response) pairs for Rehearse rows. Tools are
    ranked with the noisy channel (`DEFAULT_RELEVANCE`), as the CLI and the Run tab do."""
    return RunSettings(mode="parallel", branches=branches, selector="logprob", seed=seed, shadow=True,
                       max_steps_per_turn=4, relevance=DEFAULT_RELEVANCE)


def run_episode(task_id: str, policy: Any, settings: RunSettings, max_turns: int | None,
                deadline: float | None = None) -> Episode:
    """An EpisodeRunner episode, stopped after `max_turns` turns or at `deadline` (perf_counter);
    a turn cut short is not judged and so counts nowhere."""
    from app.engine import EpisodeRunner

    runner = EpisodeRunner(envs.load_task(task_id), policy, settings)
    while not runner.done and (max_turns is None or runner.turn < max_turns):
        if deadline is not None and time.perf_counter() > deadline:
            break
        runner.step()
    runner.stop()
    return runner.episode


def _category(task_id: str) -> str:
    """`bfcl:multi_turn_base_12` -> `multi_turn_base`, `tau2:airline/...` -> `tau2:airline`; a task id without an
    index is its own category."""
    if task_id.startswith("tau2:"):
        return task_id.split("/", 1)[0]
    name = task_id.split(":", 1)[-1]
    head, _, tail = name.rpartition("_")
    return head if tail.isdigit() else name


def forced_rehearsal(policy: Any, task_ids: list[str], max_calls: int | None = None, batch: int = 8,
                     constrain: bool = True, memory: Any = None, memory_k: int = 3,
                     details: list[dict[str, Any]] | None = None,
                     rehearsal_context: str = "history") -> dict[str, Any]:
    """Rehearsal fidelity on the ground-truth calls of `task_ids`, each with its real history (every model sees
    the same calls), by access (read-only, state-changing) and category, with the looping predictions counted.

    `memory` (`RehearsalMemory`): each prompt carries the `memory_k` transitions it retrieves in `seed` scope (the
    training split's), never the task's own, except the task's earlier ground-truth calls (observed earlier in
    the same episode; passed as `recent`, so nothing is written to the memory).
    `details` receives one dict per call (task, tool, arguments, actual, text, metrics, what was retrieved).
    `rehearsal_context="history+state"`: each prompt also shows the state before the call (`formats.state_section`).
    """
    from app.engine.memory import MemoryScope, observed
    from model_backend.base import GenerationConfig

    items: list[tuple[str, Any, Any, Any, Any]] = []  # task, call, actual, tool, retrieved
    prompts = []
    for task_id in task_ids:
        task = envs.load_task(task_id)
        episode = expert_episode(task)
        scope = MemoryScope("seed", task_id=task_id, episode_id=episode.id, exclude_task=True)
        recent: list[Transition] = []  # the task's earlier ground-truth calls: observed earlier in the episode
        for view in replay(episode, task):
            b = view.step.chosen_branch
            if b.kind != "call" or b.call is None or (max_calls is not None and len(prompts) >= max_calls):
                continue
            tool = tool_named(view.tools, b.call.name)
            examples = memory.retrieve(b.call, scope, memory_k, recent) if memory is not None else []
            prompts.append(view.rehearse_prompt(b.call, rehearsal_context, constrain=constrain, examples=examples))
            items.append((task_id, b.call, b.actual, tool, examples))
            recent += observed(view.step, task_id=task_id, split=task.extra.get("split"), episode_id=episode.id,
                               tools={t.name: t for t in view.tools})
    config = GenerationConfig(max_new_tokens=128, temperature=0.0, stop=REHEARSE_STOP)
    metrics, groups, loops = [], {}, 0
    for i in tqdm(range(0, len(prompts), batch), desc="forced rehearsal", unit="batch", leave=False):
        for gen, (task_id, call, actual, tool, examples) in zip(policy.rehearse(prompts[i:i + batch], config),
                                                                items[i:i + batch]):
            predicted, error = parse_result(gen.text)
            m = compare(predicted, error is None, actual)
            metrics.append(m)
            loops += looping(gen.text)
            access = "unknown tool" if tool is None else ("read-only" if tool.read_only else "state-changing")
            for key in (f"access:{access}", f"category:{_category(task_id)}"):
                groups.setdefault(key, []).append(m)
            if details is not None:
                details.append({"task": task_id, "tool": call.name, "arguments": call.arguments, "access": access,
                                "actual": actual, "text": gen.text, **m.model_dump(exclude={"surprise"}),
                                "memory": [h.model_dump() for h in examples]})
    fields = ("n", "exact", "field_f1", "error_agree", "json_valid")
    agg = aggregate(metrics)
    out: dict[str, Any] = {k: agg[k] for k in fields}
    out["looping"] = loops
    out["by_access"] = {k.split(":", 1)[1]: {f: aggregate(v)[f] for f in fields}
                        for k, v in sorted(groups.items()) if k.startswith("access:")}
    out["by_category"] = {k.split(":", 1)[1]: {f: aggregate(v)[f] for f in fields}
                          for k, v in sorted(groups.items()) if k.startswith("category:")}
    out["memory"] = {"k": memory_k, "transitions": len(memory)} if memory is not None else None
    out["rehearsal_context"] = rehearsal_context
    return out


def forced_answers(policy: Any, task_ids: list[str], settings: RunSettings | None = None, batch: int = 4,
                   details: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The Act role at each turn's end after the turn's ground-truth calls and their real results (every model sees
    the same history): does it answer (rather than call again), and on question turns (turns whose read-only calls
    returned data, `rows.answer_values`) does the answer carry that data (`rows.mentions`)? `constant`: answers
    that are the old fixed reply (`FINAL_ANSWER`). `details` receives one dict per turn."""
    from app.formats import ACT_STOP, parse_action
    from app.training.rows import FINAL_ANSWER, act_row_prompt, mentions, turn_ends
    from model_backend.base import GenerationConfig

    settings = settings or RunSettings()
    ctx = PromptContext(policy.count_tokens, policy.context_window, settings=settings)
    items: list[tuple[str, int, list[str]]] = []
    prompts = []
    for task_id in task_ids:
        task = envs.load_task(task_id)
        for view, values in turn_ends(expert_episode(task), task):
            prompts.append(act_row_prompt(view, ctx))
            items.append((task_id, view.step.turn, values))
    config = GenerationConfig(max_new_tokens=settings.max_action_tokens, temperature=0.0, stop=ACT_STOP)
    answered = questions = carried = constant = 0
    for i in tqdm(range(0, len(prompts), batch), desc="forced answers", unit="batch", leave=False):
        for gen, (task_id, turn, values) in zip(policy.act_each(prompts[i:i + batch], config), items[i:i + batch]):
            is_answer = parse_action(gen.text).kind == "answer"
            carries = bool(values) and is_answer and mentions(gen.text, values)
            answered += is_answer
            constant += is_answer and gen.text.strip() == FINAL_ANSWER
            questions += bool(values)
            carried += carries
            if details is not None:
                details.append({"task": task_id, "turn": turn, "text": gen.text, "answer": is_answer,
                                "question": bool(values), "mentions": carries})
    n = len(prompts)
    return {"turns": n, "answered": round(answered / n, 3) if n else None, "constant": constant,
            "question_turns": questions, "mentions": round(carried / questions, 3) if questions else None}


def heldout_report(policy: Any, n_tasks: int, *, max_turns: int | None = 2, forced_calls: int = 40,
                   settings: RunSettings | None = None, minutes: float | None = None) -> dict[str, Any]:
    """Base-vs-adapter figures on the first `n_tasks` held-out tasks (index mod 4 == 3).

    `episodes`: EpisodeRunner runs (parallel rehearsal). Call accuracy = committed calls
    equal to one of the turn's ground-truth calls, over committed steps in turns that
    have ground truth. `forced`: rehearsal fidelity on the ground-truth calls with their
    real history, which also measures a model that never calls a tool by itself.
    `minutes` bounds the episodes' wall time (tasks not reached are left out and listed).
    """
    task_ids = envs.list_tasks("multi_turn_base", "heldout")[:n_tasks]
    settings = settings or rollout_settings()
    started = time.perf_counter()
    deadline = started + minutes * 60 if minutes else None
    episodes = []
    for task_id in task_ids:
        if episodes and deadline is not None and time.perf_counter() > deadline:
            break
        episodes.append(run_episode(task_id, policy, settings, max_turns, deadline))
    report = episode_metrics(episodes)
    # Every rehearsed branch with an actual response (committed or shadow), read-only vs state-changing.
    report["rehearsal_by_access"] = {k: {m: v[m] for m in ("n", "exact", "field_f1", "error_agree")}
                                     for k, v in fidelity_by(episodes, access_of).items()}
    report["forced"] = forced_rehearsal(policy, task_ids, forced_calls, constrain=settings.constrain,
                                        rehearsal_context=settings.rehearsal_context)
    report["tasks"] = [e.task_id for e in episodes]
    report["max_turns"] = max_turns
    report["relevance"] = settings.relevance
    report["rehearsal_context"] = settings.rehearsal_context
    report["seconds"] = round(time.perf_counter() - started, 1)
    return report


# ---------------------------------------------------------------- the pipeline


def _policy_for(loaded: Any, model: Any) -> Any:
    """An inference policy over the model being trained (same object: it sees every update, so it keeps
    no `score` results from one round to the next)."""
    from model_backend.loading import LoadedModel
    from model_backend.policy import TransformersPolicy

    return TransformersPolicy(LoadedModel(model, loaded.tokenizer, loaded.spec, loaded.device, loaded.dtype,
                                          0.0, False, adapter="(in training)"), score_memo=0)


def _count(rows: list[Any]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in rows:
        out[f"{r.source}_{r.role}"] = out.get(f"{r.source}_{r.role}", 0) + 1
    return out


def train_agent(cfg: AgentTrainingConfig, report: Report = log.info,
                progress_factory: Callable[[str, int], Callable[[Any], None]] | None = None) -> dict[str, Any]:
    """Run the whole pipeline; returns the model card's data (also written to `cfg.out`)."""
    import torch

    from model_backend import load_model
    from model_backend.training import TrainConfig, encode_rows, save_adapter, train, trainable_model

    started = time.perf_counter()
    rng = random.Random(cfg.seed)
    loaded = load_model(cfg.spec, adapter=cfg.parent)  # peft wraps this copy; trainable_model continues it
    tok = loaded.tokenizer
    memory = None
    if cfg.memory_k > 0:
        from app.engine.memory import RehearsalMemory
        from app.training.memory_seed import seed_transitions, training_task_ids

        memory = RehearsalMemory(None, seed_transitions(training_task_ids(("bfcl",))))
        report(f"rehearsal memory for Rehearse rows: {len(memory)} training-split transitions {memory.counts()}")
    ctx = PromptContext(lambda text: len(tok.encode(text, add_special_tokens=False)),
                        int(getattr(loaded.model.config, "max_position_embeddings", 8192)),
                        memory=memory, memory_k=cfg.memory_k, memory_share=cfg.memory_share,
                        state_share=cfg.state_share)

    def run_round(name: str, rows: list[Any], steps: int, minutes: float, model: Any) -> RoundSummary:
        encoded, dropped = encode_rows(tok, rows, cfg.max_seq_len, cfg.pack_len)
        tc = TrainConfig(steps=steps, lr=cfg.lr, rank=cfg.rank, max_seconds=minutes * 60, seed=cfg.seed,
                         max_seq_len=cfg.max_seq_len, pack_len=cfg.pack_len)
        report(f"{name}: {len(rows)} rows ({len(dropped)} over {cfg.max_seq_len} tokens dropped) "
               f"in {len(encoded)} sequences; up to {steps} steps / {minutes:.0f} min")
        progress = progress_factory(name, steps) if progress_factory else None
        result = train(model, encoded, tc, progress=progress, dropped=len(dropped))
        report(f"{name}: {json.dumps(result.summary())}")
        return RoundSummary(name, _count(rows), {**result.summary(), "sequences": len(encoded)})

    # 1. expert rows
    train_ids = envs.list_tasks("multi_turn_base", "train")[:cfg.train_tasks]
    other_ids = [t for c in cfg.rehearse_categories if c != "multi_turn_base"
                 for t in envs.list_tasks(c, "train")[:cfg.train_tasks]]
    rows, experts = expert_rows(train_ids, ctx, cfg.explore, cfg.seed)
    other_rows, _ = expert_rows(other_ids, ctx, cfg.explore, cfg.seed) if other_ids else ([], [])
    act = [r for r in rows if r.role == "act"]
    if cfg.act_tasks is not None:
        act = act_rows_of_tasks(act, cfg.act_tasks, rng)
    elif cfg.act_rows is not None:
        rng.shuffle(act)
        act = act[:cfg.act_rows]
    rehearse = [r for r in rows + other_rows if r.role == "rehearse"]
    if "multi_turn_base" not in cfg.rehearse_categories:
        rehearse = [r for r in other_rows if r.role == "rehearse"]
    explored = [r for r in rehearse if r.source == "explore"]
    rehearse = [r for r in rehearse if r.source != "explore"]
    rng.shuffle(rehearse)
    rng.shuffle(explored)
    round1_rows = act + rehearse[:cfg.rehearse_rows] + explored[:cfg.explore_rows]
    report(f"expert traces: {len(experts)} tasks, {len(act)} Act rows, {len(rehearse)} Rehearse rows "
           f"({len(rehearse[:cfg.rehearse_rows])} used), {len(explored)} explored Rehearse rows "
           f"({len(explored[:cfg.explore_rows])} used)")
    if cfg.single_turn_rows:
        single = single_turn_rows(ctx)
        rng.shuffle(single)
        single = single if cfg.single_turn_rows < 0 else single[:cfg.single_turn_rows]
        round1_rows += single
        report(f"single-turn tool selection: {len(single)} Act rows")

    # 2. joint training (a new LoRA, or the parent's continued)
    if cfg.parent is not None:
        report(f"continuing {cfg.parent}")
    model = trainable_model(loaded, TrainConfig(rank=cfg.rank, seed=cfg.seed))
    rounds = [run_round("round 1 (expert)", round1_rows, cfg.round1_steps, cfg.round1_minutes, model)]

    # 3. reward-filtered self-training: each round rolls out on tasks the earlier rounds did not use
    policy = _policy_for(loaded, model)
    rollout_ids = list(train_ids)
    rng.shuffle(rollout_ids)
    all_episodes: list[Episode] = []
    for n in range(1, cfg.self_rounds + 1):
        todo = rollout_ids[(n - 1) * cfg.rollout_tasks:n * cfg.rollout_tasks] or rollout_ids[:cfg.rollout_tasks]
        episodes: list[Episode] = []
        t0 = time.perf_counter()
        deadline = t0 + cfg.rollout_minutes * 60
        for task_id in todo:
            if episodes and time.perf_counter() > deadline:
                break
            episodes.append(run_episode(task_id, policy, rollout_settings(cfg.seed, cfg.rollout_branches),
                                        cfg.rollout_turns, deadline))
            ep = episodes[-1]
            report(f"rollout {n} {task_id}: turns passed {sum(t.success for t in ep.turn_results)}/"
                   f"{len(ep.turn_results)}, {len(ep.steps)} steps, {ep.shadow_calls} shadow calls")
        all_episodes += episodes
        rollout = episode_metrics(episodes)
        self_rows = self_training_rows(episodes, ctx)
        replay_rows = rng.sample(round1_rows, min(cfg.expert_replay_rows, len(round1_rows)))
        report(f"self-training {n}: {len(self_rows)} rows kept from {len(episodes)} episodes; "
               f"{len(replay_rows)} expert rows replayed")
        rounds.append(run_round(f"round {n + 1} (self-training)", self_rows + replay_rows, cfg.round2_steps,
                                cfg.round2_minutes, model))
        rounds[-1].extra = {"rollout": rollout, "rollout_seconds": round(time.perf_counter() - t0, 1),
                            "shadow_calls": sum(e.shadow_calls for e in episodes)}
    episodes = all_episodes

    # 4. save, then evaluate base and adapter on held-out tasks
    card: dict[str, Any] = {
        "base_model": "SmolLM2-135M-Instruct (embedded GGUF Q4_1, dequantized to fp32)",
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()},
        "parent": str(cfg.parent) if cfg.parent else None,
        "data": {"expert_tasks": len(train_ids), "split": "multi_turn_base, index mod 4 != 3",
                 "rehearse_categories": list(cfg.rehearse_categories), "rehearse_tasks": len(train_ids) + len(other_ids),
                 "memory": {"k": cfg.memory_k, "share": cfg.memory_share, "transitions": len(memory)}
                 if memory is not None else None, "state_share": cfg.state_share, "explore": cfg.explore,
                 "expert_rows": _count(rows + other_rows), "round1_rows": _count(round1_rows),
                 "self_training_episodes": [e.task_id for e in episodes]},
        "rounds": [asdict(r) for r in rounds],
        "hardware": _hardware(torch),
        "train_seconds": round(time.perf_counter() - started, 1),
    }
    save_adapter(model, cfg.out, {"training.json": json.dumps(card, indent=2, default=str)}, replace=True)
    report(f"adapter saved to {cfg.out}")
    if cfg.eval_tasks > 0:
        card["heldout"] = heldout_comparison(policy, cfg, report)
    card["total_seconds"] = round(time.perf_counter() - started, 1)
    write_card(cfg.out, card)
    return card


HELDOUT_ROWS: dict[str, str] = {
    "base": "base SmolLM2-135M",
    "previous": "previous adapter",
    "previous_unconstrained": "previous adapter, unconstrained",
    "adapter_unconstrained": "this adapter, unconstrained",
    "adapter_unranked": "this adapter, no tool ranking",
    "adapter": "this adapter",
}
"""Columns of the card's held-out table, in order; constrained decoding unless the name says otherwise,
tools ranked by the noisy channel (`rollout_settings`) unless it says otherwise or its `relevance` is 0
(a column measured before the ranking existed has no `relevance` and ranked nothing)."""


def heldout_comparison(adapter_policy: Any, cfg: AgentTrainingConfig, report: Report = log.info,
                       previous: Path | None = None, columns: set[str] | None = None) -> dict[str, Any]:
    """`heldout_report` for the adapter (constrained and not, ranked and not), the base weights and, when
    given, a previous adapter (constrained and not), on the same tasks and rollout settings; `columns`:
    only these `HELDOUT_ROWS`."""
    from model_backend import load_model
    from model_backend.policy import TransformersPolicy

    kwargs = dict(max_turns=cfg.eval_turns, forced_calls=cfg.eval_forced_calls, minutes=cfg.eval_minutes or None)
    constrained = rollout_settings(cfg.seed)
    free = constrained.model_copy(update={"constrain": False})
    unranked = constrained.model_copy(update={"relevance": 0.0})
    runs: list[tuple[str, Callable[[], Any], RunSettings]] = [
        ("adapter", lambda: adapter_policy, constrained), ("adapter_unconstrained", lambda: adapter_policy, free),
        ("adapter_unranked", lambda: adapter_policy, unranked),
        # Fresh loads: peft wraps a model in place.
        ("base", lambda: TransformersPolicy(load_model(cfg.spec)), constrained)]
    if previous is not None:
        prev: list[Any] = []

        def previous_policy() -> Any:
            if not prev:
                prev.append(TransformersPolicy(load_model(cfg.spec, adapter=previous, merge_adapter=True)))
            return prev[0]

        runs.append(("previous", previous_policy, constrained))
    out: dict[str, Any] = {}
    earlier = _earlier_heldout(previous, cfg) if previous is not None else None
    if earlier is not None and (columns is None or "previous_unconstrained" in columns):
        out["previous_unconstrained"] = earlier  # measured on this protocol by its own card
        report("held-out, previous_unconstrained: taken from the previous adapter's card (same protocol)")
    elif previous is not None:
        runs.append(("previous_unconstrained", previous_policy, free))
    for name, policy, settings in runs:
        if columns is not None and name not in columns:
            continue
        out[name] = heldout_report(policy(), cfg.eval_tasks, settings=settings, **kwargs)
        report(f"held-out, {name}: {json.dumps(out[name])}")
    return out


def _earlier_heldout(previous: Path, cfg: AgentTrainingConfig) -> dict[str, Any] | None:
    """The previous adapter's own held-out row, when its card measured it on this protocol before
    constrained decoding existed (so: unconstrained); None otherwise."""
    path = previous / "training.json"
    if not path.is_file():
        return None
    card = json.loads(path.read_text())
    row, conf = card.get("heldout", {}).get("adapter"), card.get("config", {})
    same = (conf.get("eval_tasks"), conf.get("eval_turns"), conf.get("eval_forced_calls"), conf.get("eval_minutes")) == (
        cfg.eval_tasks, cfg.eval_turns, cfg.eval_forced_calls, cfg.eval_minutes)
    return row if row is not None and same and "parse_error_rate" not in row else None


def evaluate_adapter(adapter_dir: Path, cfg: AgentTrainingConfig, report: Report = log.info,
                     previous: Path | None = None, columns: set[str] | None = None) -> dict[str, Any]:
    """Add the held-out table to an adapter that `train_agent` wrote (its card is rewritten);
    `previous`: an earlier adapter to compare with (e.g. the one it replaces, from git history);
    `columns`: measure only these `HELDOUT_ROWS` and keep the card's other columns as they are (on the same
    protocol: a card measured on another one is an error)."""
    from model_backend import load_model
    from model_backend.policy import TransformersPolicy

    card_path = adapter_dir / "training.json"
    if not card_path.is_file():
        raise FileNotFoundError(f"{adapter_dir} has no training.json: it was not written by train-agent")
    card = json.loads(card_path.read_text())
    protocol = ("eval_tasks", "eval_turns", "eval_forced_calls", "eval_minutes")
    if columns is not None:
        unknown = sorted(columns - set(HELDOUT_ROWS))
        if unknown:
            raise ValueError(f"unknown held-out column(s) {', '.join(unknown)}; choose from {', '.join(HELDOUT_ROWS)}")
        if card.get("heldout") and any(card["config"].get(k) != getattr(cfg, k) for k in protocol):
            was = ", ".join(f"{k}={card['config'].get(k)}" for k in protocol)
            raise ValueError(f"the card's held-out table was measured on another protocol ({was}): measure every column")
    started = time.perf_counter()
    policy = TransformersPolicy(load_model(cfg.spec, adapter=adapter_dir))
    measured = heldout_comparison(policy, cfg, report, previous, columns)
    card["heldout"] = {**(card.get("heldout") or {}), **measured} if columns is not None else measured
    if previous is not None:
        card["heldout_previous"] = str(previous)
    card["config"].update({k: getattr(cfg, k) for k in protocol})
    kept = card.get("eval_seconds", 0.0) if columns else 0.0  # the kept columns' share
    card["eval_seconds"] = round(time.perf_counter() - started + kept, 1)
    card["total_seconds"] = round(card["train_seconds"] + card["eval_seconds"], 1)
    write_card(adapter_dir, card)
    return card


def _hardware(torch: Any) -> dict[str, Any]:
    import os

    return {"device": "cuda" if torch.cuda.is_available() else "cpu", "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "python": platform.python_version(), "machine": platform.machine()}


# ---------------------------------------------------------------- model card


def _fmt(value: Any) -> str:
    if value is None:
        return "n/a"
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def _rollout_line(card: dict[str, Any]) -> str:
    extra = card["rounds"][-1].get("extra", {}) if card.get("rounds") else {}
    r = extra.get("rollout")
    if not r:
        return ""
    passed = round((r.get("turn_success") or 0) * r["turns"])
    return (f" The rollouts passed {passed} of {r['turns']} turns, with call accuracy {_fmt(r.get('call_accuracy'))} "
            f"over {r['steps']} steps.")


def card_markdown(card: dict[str, Any]) -> str:
    cfg, data = card["config"], card["data"]
    lines = [
        "---", "base_model: HuggingFaceTB/SmolLM2-135M-Instruct", "library_name: peft", "tags: [lora, envace, bfcl]", "---",
        f"# {ADAPTER_NAME}: an EnvACE-style agent adapter for SmolLM2-135M-Instruct", "",
        "One LoRA adapter, two roles: **Act** (writes `<tool_call>{...}</tool_call>` or a plain answer) and "
        "**Rehearse** (predicts the tool's response as `<execution_result>{json}</execution_result>`), trained "
        "jointly. Built by `python -m app train-agent` (`make train-agent`).", "",
        "## Data",
        f"- Expert traces: the ground-truth calls of {data['expert_tasks']} BFCL `{data['split']}` tasks executed "
        "in the real API classes; Act targets are the calls plus a short final answer at each turn end, Rehearse "
        "targets the real responses. Prompts are the engine's own (`act_prompt`, `rehearse_prompt`).",
        f"- Rows: {json.dumps(data['expert_rows'])}; round 1 uses "
        + (f"{cfg['act_rows']} Act rows" if cfg.get("act_rows") is not None else "every Act row") + " and "
        + (f"{cfg['rehearse_rows']} Rehearse rows sampled at random." if cfg.get('rehearse_rows') else "every Rehearse row.")
        + (f" {cfg['state_share']:.0%} of the Rehearse rows show the state before the call (the tool's own class's, "
           "`rehearsal_context=history+state`), the others the history alone." if cfg.get("state_share") else "")
        + (f" Explored calls: {cfg['explore']} sampled call(s) on a fork before each expert call (the same tool or "
           "another, with arguments of the training split's ground truth), Rehearse rows of their real responses, "
           "errors included; " + (f"{cfg['explore_rows']} used." if cfg.get("explore_rows") is not None else "all used.")
           if cfg.get("explore") else ""),
        f"- Self-training: {cfg.get('self_rounds', 1)} round(s) of parallel-rehearsal rollouts "
        f"(K={cfg.get('rollout_branches', 2)}, logprob selector, schema-constrained decoding) on "
        f"{len(data['self_training_episodes'])} training tasks; Act rows kept only from turns that pass the BFCL "
        "state/response check, Rehearse rows from every real response, the shadow executions of non-chosen calls "
        "on forks included." + _rollout_line(card),
        *([f"- Warm start: continues the adapter `{card['parent']}` (its own training is not counted here)."]
          if card.get("parent") else []), "",
        "## Training",
        f"- LoRA r={cfg['rank']}, alpha={2 * cfg['rank']}, all linear layers, lr {cfg['lr']} (warmup, cosine to 10%), seed {cfg['seed']}.",
        f"- Sequence length: single rows over {cfg['max_seq_len']} tokens dropped (never truncated); the Act rows of "
        f"one task share a sequence of up to {cfg['pack_len']} tokens (their prompts extend each other token for "
        "token, so each target sees exactly its inference prompt).",
        f"- Time budgets: round 1 {cfg['round1_minutes']:g} min (at most {cfg['round1_steps']} steps), rollouts "
        f"{cfg['rollout_minutes']:g} min ({cfg['rollout_tasks']} tasks, first {cfg['rollout_turns']} turns), round 2 "
        f"{cfg['round2_minutes']:g} min (at most {cfg['round2_steps']} steps); each round's schedule follows whichever "
        "of steps or time runs out first.", "",
        "| round | rows | steps | s/step | tokens/s | loss first -> last | minutes |", "|---|---|---|---|---|---|---|",
    ]
    for r in card["rounds"]:
        t = r["train"]
        lines.append(f"| {r['name']} | {sum(r['rows'].values())} | {t['steps']} | {t['s_per_step']} | "
                     f"{t['tokens_per_s']} | {_fmt(t['loss_first'])} -> {_fmt(t['loss_last'])} | "
                     f"{t['seconds'] / 60:.1f} |")
    hw = card["hardware"]
    lines += ["", f"Hardware: {hw['device']}, {hw['cpus']} CPU cores, torch {hw['torch']}. "
              f"Training wall time {card['train_seconds'] / 60:.1f} min; with evaluation "
              f"{card.get('total_seconds', card['train_seconds']) / 60:.1f} min.", ""]
    held = card.get("heldout")
    if held:
        a = held.get("adapter") or next(iter(held.values()))
        cols = [k for k in HELDOUT_ROWS if k in held]
        lines += [
            "## Held-out results (BFCL multi_turn_base, index mod 4 == 3)",
            f"Episodes: {len(a['tasks'])} tasks, first {a['max_turns']} turns each, parallel rehearsal K=2, "
            "schema-constrained decoding unless a column says otherwise. Call accuracy: committed calls equal "
            "(canonical name + arguments) to one of the turn's ground-truth calls, over committed steps. "
            "Forced rehearsal: every model rehearses the same ground-truth calls with their real history."
            + (f" Previous adapter: `{card['heldout_previous']}`." if card.get("heldout_previous") else ""), "",
            "| metric | " + " | ".join(HELDOUT_ROWS[k] for k in cols) + " |", "|---|" + "---|" * len(cols),
        ]
        lines.append("| tool ranking weight (relevance) | "
                     + " | ".join(_fmt(float(held[k].get("relevance", 0.0))) for k in cols) + " |")
        lines.append("| Rehearse prompt (rehearsal context) | "
                     + " | ".join(held[k].get("rehearsal_context", "history") for k in cols) + " |")
        rows = [("call accuracy", "call_accuracy"), ("tool-call rate", "call_rate"),
                ("parse errors / step", "parse_error_rate"), ("turn success", "turn_success")]
        for label, key in rows:
            lines.append(f"| {label} | " + " | ".join(_fmt(held[k].get(key)) for k in cols) + " |")
        for scope in ("rehearsal", "forced"):
            for key in ("exact", "field_f1", "error_agree", "json_valid"):
                where = "episode" if scope == "rehearsal" else "forced"
                lines.append(f"| {where} rehearsal {key} | "
                             + " | ".join(_fmt(held[k].get(scope, {}).get(key)) for k in cols) + " |")
            lines.append(f"| {where} rehearsal n | " + " | ".join(_fmt(held[k].get(scope, {}).get("n")) for k in cols) + " |")
        for access in ("read-only", "state-changing"):
            for key in ("exact", "error_agree", "n"):
                lines.append(f"| all rehearsed branches, {access}: {key} | " + " | ".join(
                    _fmt(held[k].get("rehearsal_by_access", {}).get(access, {}).get(key)) for k in cols) + " |")
        if card.get("eval_note"):
            lines += ["", f"Note: {card['eval_note']}"]
    lines += ["", "Full figures: `training.json`."]
    return "\n".join(lines) + "\n"


def write_card(out: Path, card: dict[str, Any]) -> None:
    """README.md and training.json next to the weights (each replaced atomically)."""
    for name, text in (("training.json", json.dumps(card, indent=2, default=str)), ("README.md", card_markdown(card))):
        tmp = out / f".{name}.tmp"
        tmp.write_text(text)
        tmp.replace(out / name)


__all__ = ["ADAPTER_NAME", "AgentTrainingConfig", "SHIPPED_ADAPTER", "call_matches", "card_markdown",
           "default_adapter_path", "episode_metrics", "evaluate_adapter", "forced_rehearsal", "heldout_comparison",
           "heldout_report", "run_episode",
           "train_agent", "write_card"]
