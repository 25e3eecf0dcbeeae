"""Light fine-tuning on corrected traces: select, validate, train from the parent adapter, register.

Nothing changes unless everything succeeds: the inputs are validated before the model
loads, the new adapter is written atomically to a new directory (the parent is only
read), and the registry rows (`adapters`, `finetune_runs`) are written in one transaction
after the adapter exists; if that transaction fails the new directory is removed.
"""
from __future__ import annotations

import json
import logging
import random
import shutil
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from app import envs
from app.formats import REHEARSE_STOP, canonical_call, canonical_json, parse_action, parse_result, rehearse_target
from app.records import Annotation, Episode, utcnow
from app.store import Store
from app.training.rows import (CorrectionError, PromptContext, correction_rows, episode_rows, expert_episode,
                               expert_rows, parse_corrected_action)

log = logging.getLogger(__name__)

MAX_STEPS = 10_000
MAX_HELDOUT_ROWS = 64
HELDOUT_TASKS = 4
"""Held-out tasks whose expert replays the held-out sample is drawn from (enough rows, still fast)."""
MAX_UNSEEN_ROWS = 200
UNSEEN_TASKS = 50
"""Held-out tasks whose expert replays the unseen calls are drawn from (every one of their real transitions)."""
CORRECTED, OTHERS = "corrected tools", "other tools"
REPLAY_RATIO = 1.0
"""Replay rows per correction row (the tab's and the CLI's default)."""
MAX_REPLAY_RATIO = 10.0
EVAL_EVERY = 5
"""Checkpoint every N steps (the tab's and the CLI's default; the library's is 0: no checkpoints)."""
SELECTION_ROWS = 12
"""Validation calls per group measured at each checkpoint (NLL: a forward pass each)."""
PATIENCE = 2
"""Checkpoints without a better corrected-tools NLL before training stops."""
CHECKPOINT_WORSE = 0.10
"""At a checkpoint, the other tools are worse when their validation NLL rose by more than this share of the
parent's: training stops there and that checkpoint cannot be kept."""
WORSE_BY = 0.02
"""A child is not made the default when its Rehearse exact on the other tools' unseen calls fell by more."""
REPLAY_SOURCE = "replay"


class FinetuneError(ValueError):
    """A fine-tune request that cannot run (the message says why); nothing was changed."""


@dataclass
class FinetuneRequest:
    """One fine-tune: which corrections, how to train, where the new adapter goes."""

    out: Path
    steps: int = 30
    lr: float = 3e-4
    rank: int = 16
    """Used for a new adapter; a parent adapter keeps its own rank."""
    parent: Path | None = None
    """The adapter to continue (None: a new adapter on the base weights)."""
    episodes: list[str] | None = None
    """Only corrections in these episodes (None: all)."""
    annotated: bool = False
    """Also use annotated branches without a correction: their real response is the Rehearse target."""
    spec: str = "embedded"
    seed: int = 0
    measure_agreement: bool = True
    """Greedy generation before and after: Act agreement on the Act rows, Rehearse exact on the
    Rehearse rows (costs a few seconds per row)."""
    heldout_rows: int = 0
    """Rows sampled from expert replays of held-out BFCL tasks, measured before and after like
    the corrections: a fine-tune should fix the corrected cases without hurting the rest (0: skip)."""
    unseen_rows: int = 0
    """Real calls never trained on, per group, measured before and after (Rehearse exact and NLL): calls of the
    corrected tools, and a fixed sample of calls of the other tools (`unseen_probe`; 0: skip)."""
    replay_ratio: float = 0.0
    """Replay rows mixed in per correction row, against forgetting: a seeded sample of the rows the shipped
    adapter was trained on (expert replays of the BFCL training split), the corrections' role mix (0: none)."""
    eval_every: int = 0
    """Checkpoints every N steps and after the last (`steps` is then the most): the validation calls' NLL is
    measured, training stops early when the corrected tools stop improving or the other tools get worse, and the
    best checkpoint, the parent's weights included, is kept (0: no checkpoints; all `steps` are trained)."""
    selection_rows: int = SELECTION_ROWS
    """Validation calls per group for the checkpoints (training-split replays, never the reported unseen calls)."""
    patience: int = PATIENCE
    worse_by: float = WORSE_BY
    """The other tools' unseen exact may fall by at most this for the child to become the default."""


@dataclass
class Selected:
    """One annotated branch chosen for training."""

    annotation_id: int
    branch_id: int
    episode_id: str
    step_idx: int
    branch_idx: int
    annotation: Annotation


@dataclass
class FinetuneResult:
    adapter_id: str
    path: Path
    run_id: int
    parent: str | None
    data: dict[str, Any]
    losses: list[float]
    metrics: dict[str, Any] = field(default_factory=dict)


def validate_request(req: FinetuneRequest) -> None:
    """Clear errors for bad numbers and paths, before anything loads."""
    from model_backend.training import is_adapter_dir

    if not 1 <= req.steps <= MAX_STEPS:
        raise FinetuneError(f"--steps must be between 1 and {MAX_STEPS}, got {req.steps}")
    if not req.lr > 0 or req.lr > 1:
        raise FinetuneError(f"--lr must be > 0 and at most 1, got {req.lr}")
    if not 1 <= req.rank <= 256:
        raise FinetuneError(f"--rank must be between 1 and 256, got {req.rank}")
    if not 0 <= req.heldout_rows <= MAX_HELDOUT_ROWS:
        raise FinetuneError(f"held-out rows must be between 0 and {MAX_HELDOUT_ROWS}, got {req.heldout_rows}")
    if not 0 <= req.unseen_rows <= MAX_UNSEEN_ROWS:
        raise FinetuneError(f"unseen calls must be between 0 and {MAX_UNSEEN_ROWS}, got {req.unseen_rows}")
    if not 0 <= req.replay_ratio <= MAX_REPLAY_RATIO:
        raise FinetuneError(f"--replay-ratio must be between 0 and {MAX_REPLAY_RATIO:g}, got {req.replay_ratio}")
    if not 0 <= req.eval_every <= MAX_STEPS:
        raise FinetuneError(f"--eval-every must be between 0 (no checkpoints) and {MAX_STEPS}, got {req.eval_every}")
    if not 1 <= req.selection_rows <= MAX_UNSEEN_ROWS or req.patience < 1:
        raise FinetuneError(f"validation calls must be 1-{MAX_UNSEEN_ROWS} and patience at least 1")
    if not 0 <= req.worse_by <= 1:
        raise FinetuneError(f"--worse-by must be between 0 and 1, got {req.worse_by}")
    if Path(req.out).exists():
        raise FinetuneError(f"--out {req.out} already exists; choose a new directory")
    if req.parent is not None and not is_adapter_dir(req.parent):
        raise FinetuneError(f"parent {req.parent} is not a LoRA adapter directory "
                            "(needs adapter_config.json and adapter weights)")


def select_corrections(store: Store, episodes: list[str] | None = None, annotated: bool = False) -> list[Selected]:
    """Annotated branches with a correction (and, with `annotated`, those without one),
    the latest annotation per branch; corrections are validated here."""
    latest: dict[int, dict[str, Any]] = {}
    for row in store.latest_annotations():
        if episodes and row["episode_id"] not in episodes:
            continue
        latest[row["branch_id"]] = row  # later annotations of a branch supersede earlier ones
    out = []
    for row in latest.values():
        try:
            ann = Store.annotation_from_row(row)
        except json.JSONDecodeError:
            raise FinetuneError(f"annotation {row['aid']}: the stored corrected response is not valid JSON") from None
        if not ann.corrected and not annotated:
            continue
        try:
            if (ann.corrected_action or "").strip():
                parse_corrected_action(ann, row["aid"])
        except CorrectionError as exc:
            raise FinetuneError(str(exc)) from None
        out.append(Selected(row["aid"], row["branch_id"], row["episode_id"], row["step_idx"], row["bidx"], ann))
    if not out:
        scope = f" in episodes {', '.join(episodes)}" if episodes else ""
        what = "annotated or corrected" if annotated else "corrected"
        raise FinetuneError(f"no {what} branches{scope} in {store.path}; annotate some branches first"
                            + ("" if annotated else " (or pass --annotated to use annotated ones)"))
    return out


def build_rows(store: Store, selected: list[Selected], ctx: PromptContext, notes: list[str] | None = None) -> list[Any]:
    """Training rows for the selected branches, episode by episode.

    Benchmark episodes, typed instructions and imported episodes alike: each prompt is rebuilt from the episode's
    stored history (`episode_task`). What really cannot become a row (an episode whose task cannot be rebuilt, a
    plain answer where the episode forced tool calls) is left out with a line in `notes` (logged when None) and
    the rest is built."""
    from app.service.catalog import episode_task, task_env

    notes = [] if notes is None else notes
    start = len(notes)
    rows: list[Any] = []
    by_episode: dict[str, list[Selected]] = {}
    for s in selected:
        by_episode.setdefault(s.episode_id, []).append(s)
    for episode_id, items in by_episode.items():
        episode = store.get_episode(episode_id)
        try:
            task = episode_task(episode)
            env = task_env(task)
        except ValueError as exc:
            ids = ", ".join(str(s.annotation_id) for s in items)
            notes.append(f"episode {episode_id} ({episode.task_id}): its prompts cannot be rebuilt ({exc}); "
                         f"annotation(s) {ids} left out")
            continue
        corrections = {}
        for s in items:
            ann = s.annotation
            if not ann.corrected:
                # Annotated without a correction: the real response is the Rehearse target.
                _, branch = store.get_branch(s.branch_id)
                if branch.actual_source is None or branch.call is None:
                    continue
                ann = ann.model_copy(update={"corrected_predicted": branch.actual, "corrected_predicted_set": True})
            corrections[(s.step_idx, s.branch_idx)] = (s.annotation_id, ann)
        try:
            rows += correction_rows(episode, task, corrections, ctx, env=env, notes=notes)
        except CorrectionError as exc:
            raise FinetuneError(str(exc)) from None
        finally:
            env.close()
    for note in notes[start:]:
        log.warning("left out of training: %s", note)
    return rows


# ---------------------------------------------------------------- metrics


def rehearse_budget(enc: Any) -> int:
    """The token budget of a measured Rehearse generation: as the runner's (128) or the target's length plus room
    for the tags; never so tight that the constraint's budget closing (`constrain.CLOSE_MARGIN`) cuts the value
    short (with `n_target + 8`, `{"current_working_directory": "deep_folder"}` came out as `"deep_"`)."""
    return max(128, enc.n_target + 32)


def correction_metrics(policy: Any, tokenizer: Any, rows: list[Any], agreement: bool) -> dict[str, Any]:
    """NLL of the corrected responses under Rehearse (and with `agreement`, Rehearse exact), and Act NLL and
    agreement with the corrected actions, all on `policy` (`measuring_policy`: the app's own decoding)."""
    from model_backend.base import GenerationConfig
    from model_backend.training import encode_rows, end_of_turn_text

    out: dict[str, Any] = {}
    eot = end_of_turn_text(tokenizer)
    rehearse = [r for r in rows if r.role == "rehearse"]
    if rehearse:
        encoded, _ = encode_rows(tokenizer, rehearse)
        measured = rehearse_measure(policy, rehearse, encoded, eot, decode=agreement)
        nll = [x for _, x in measured]
        out["rehearse_nll"] = round(sum(nll) / len(nll), 4)
        out["rehearse_nll_rows"] = [round(x, 4) for x in nll]
        if agreement:
            out["rehearse_exact"] = round(sum(bool(e) for e, _ in measured) / len(rehearse), 4)
    act = [r for r in rows if r.role == "act"]
    if act:
        out["act_nll"] = round(sum(target_nll(policy, act, eot)) / len(act), 4)
        if agreement:
            encoded, _ = encode_rows(tokenizer, act)  # each target's length: its decode budget
            agree = 0
            for row, enc in zip(act, encoded):
                config = GenerationConfig(max_new_tokens=enc.n_target + 8, temperature=0.0, stop=("</tool_call>",))
                text = policy.act(row.prompt, 1, config)[0].text
                agree += _same_action(text, row.prompt.prefill + row.target)
            out["act_agreement"] = round(agree / len(act), 4)
    return out


def target_nll(policy: Any, rows: list[Any], eot: str) -> list[float]:
    """Mean NLL per token of each row's target (and end of turn) after its prompt, on `policy` (`Policy.score`)."""
    scores = policy.score([r.prompt for r in rows], [r.target + eot for r in rows])
    return [-sum(lps) / len(lps) if lps else 0.0 for lps in scores]


def _same_action(text: str, target: str) -> bool:
    a, b = parse_action(text), parse_action(target)
    if a.kind != b.kind:
        return False
    if a.kind == "call":
        return canonical_call(a.call) == canonical_call(b.call)  # type: ignore[arg-type]
    return (a.answer or "").strip() == (b.answer or "").strip()


def heldout_rows(ctx: PromptContext, n: int, seed: int = 0) -> list[Any]:
    """`n` rows (half Act, half Rehearse) from expert replays of the first held-out BFCL tasks.

    Never trained on (index mod 4 == 3), the same for every fine-tune with the same seed, so
    before/after on them says whether a fine-tune hurt what it was not shown.
    """
    if n <= 0:
        return []
    rows, _ = expert_rows(envs.list_tasks("multi_turn_base", "heldout")[:HELDOUT_TASKS], ctx)
    rng = random.Random(seed)
    act = [r for r in rows if r.role == "act"]
    rehearse = [r for r in rows if r.role == "rehearse"]
    n_act = min(len(act), n // 2)
    n_rehearse = min(len(rehearse), n - n_act)
    return rng.sample(act, n_act) + rng.sample(rehearse, n_rehearse)


# ---------------------------------------------------------------- unseen calls: does it fix the tool, keep the rest?


TransitionKey = tuple[str, str]
"""(canonical call, Rehearse target text): the key of one real transition as a Rehearse row trains or measures it
(the memory's record of one is `records.Transition`). The same call in another state (`ls()` in another folder)
is another transition."""


def trained_calls(store: Store, selected: list[Selected]) -> tuple[set[str], set[TransitionKey]]:
    """(tools, transitions) the corrections train on. Tools: each corrected branch's tool, or its corrected call's.
    Transitions: each Rehearse row's (call, target), the corrected response (or, for a label alone, the real one)."""
    tools: set[str] = set()
    trained: set[TransitionKey] = set()
    for s in selected:
        _, branch = store.get_branch(s.branch_id)
        call = branch.call if branch.kind == "call" else None
        if (s.annotation.corrected_action or "").strip():
            fixed = parse_corrected_action(s.annotation, s.annotation_id)
            if fixed.call is not None:
                tools.add(fixed.call.name)
                call = call or fixed.call
        if call is not None and (s.annotation.corrected_predicted_set or not s.annotation.corrected):
            value = s.annotation.corrected_predicted if s.annotation.corrected_predicted_set else branch.actual
            tools.add(call.name)
            trained.add((canonical_call(call), rehearse_target(value)))
    return tools, trained


def unseen_probe(ctx: PromptContext, tools: set[str], trained: set[TransitionKey], n: int, seed: int = 0,
                 task_ids: list[str] | None = None) -> dict[str, list[tuple[str, Any]]]:
    """Rehearse rows of real transitions never trained on, as {group: [(tool, row)]}: up to `n` calls of the
    corrected `tools` and a fixed sample of `n` calls of the other tools, from the expert replays of the first
    `UNSEEN_TASKS` held-out BFCL tasks (never trained on; the same rows for every fine-tune with the same seed).
    A transition the fine-tune trained on (`trained`: call and target) is not unseen and is left out; each
    transition counts once, and the same call in another state is another one (an argument-free `pwd()` or
    `ls()` is measured in every state it was called in)."""
    if n <= 0:
        return {CORRECTED: [], OTHERS: []}
    ids = task_ids if task_ids is not None else envs.list_tasks("multi_turn_base", "heldout")[:UNSEEN_TASKS]
    rows, episodes = expert_rows(ids, ctx)
    calls = {f"{ep.id}/{step.index}/{b.index}": b.call for ep in episodes for step in ep.steps for b in step.branches
             if b.call is not None}
    pool: dict[str, list[tuple[str, Any]]] = {CORRECTED: [], OTHERS: []}
    seen: set[str] = set()
    for row in rows:
        call = calls.get(row.ref)
        if row.role != "rehearse" or call is None:
            continue
        key = (canonical_call(call), row.target)
        if key in trained or key in seen:
            continue  # a trained transition is not unseen; a repeated one counts once
        seen.add(key)
        pool[CORRECTED if call.name in tools else OTHERS].append((call.name, row))
    rng = random.Random(seed)
    return {group: (items if len(items) <= n else rng.sample(items, n)) for group, items in pool.items()}


SCORE_BATCH = 8  # Rehearse rows decoded together when scoring them


def rehearse_measure(policy: Any, rows: list[Any], encoded: list[Any], eot: str,
                     decode: bool = True) -> list[tuple[bool | None, float]]:
    """(greedy Rehearse output equals the target, NLL of the target) of each row (its encoding in `encoded`), both
    on `policy`. Rows with the same token budget decode in one batch (most share the 128-token floor), and each
    batch's targets are scored right after its decode: the decode left each prompt's KV in the policy's prefix
    cache, so scoring runs the target tokens only (8 Rehearse rows: 2.9 s against 23 s scored alone and 40 s
    through `nll_of_rows` on the fp32 training model, the same NLL to 3 decimals). A batch decodes each row as it
    decodes alone (`test_rehearse_batch_equals_each_alone`), so batching changes no result. Without `decode`,
    exact is None and only the NLL is measured."""
    from model_backend.base import GenerationConfig

    by_budget: dict[int, list[int]] = {}
    for i, enc in enumerate(encoded):
        by_budget.setdefault(rehearse_budget(enc), []).append(i)
    texts: dict[int, str] = {}
    nll: dict[int, float] = {}
    for budget, idx in by_budget.items():
        config = GenerationConfig(max_new_tokens=budget, temperature=0.0, stop=REHEARSE_STOP)
        for start in range(0, len(idx), SCORE_BATCH):
            part = idx[start:start + SCORE_BATCH]
            if decode:
                for i, gen in zip(part, policy.rehearse([rows[i].prompt for i in part], config)):
                    texts[i] = gen.text
            for i, x in zip(part, target_nll(policy, [rows[i] for i in part], eot)):
                nll[i] = x
    out: list[tuple[bool | None, float]] = []
    for i, row in enumerate(rows):
        exact = None
        if decode:
            predicted, error = parse_result(texts[i])
            exact = error is None and canonical_json(predicted) == canonical_json(parse_result(row.target)[0])
        out.append((exact, nll[i]))
    return out


def rehearse_scores(policy: Any, tokenizer: Any, rows: list[Any]) -> list[tuple[bool, float]]:
    """(greedy Rehearse output equals the target, NLL of the target) of each Rehearse row, on `policy`."""
    from model_backend.training import encode_rows, end_of_turn_text

    if not rows:
        return []
    encoded, _ = encode_rows(tokenizer, rows)
    return [(bool(e), x) for e, x in rehearse_measure(policy, rows, encoded, end_of_turn_text(tokenizer))]


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95% Wilson interval of a rate k/n ((0, 1) for n = 0)."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * ((p * (1 - p) / n + z * z / (4 * n * n)) ** 0.5) / (1 + z * z / n)
    return round(max(0.0, centre - half), 4), round(min(1.0, centre + half), 4)


def summarize_unseen(probe: dict[str, list[tuple[str, Any]]], before: dict[str, list[tuple[bool, float]]],
                     after: dict[str, list[tuple[bool, float]]]) -> dict[str, Any]:
    """Per group and per corrected tool: n, Rehearse exact and NLL before and after, with exact's 95% interval."""
    def agg(scores: list[tuple[bool, float]]) -> dict[str, Any]:
        n = len(scores)
        k = sum(e for e, _ in scores)
        return {"rehearse_exact": round(k / n, 4) if n else None,
                "rehearse_nll": round(sum(x for _, x in scores) / n, 4) if n else None,
                "exact_interval": list(wilson(k, n))}

    out: dict[str, Any] = {"groups": {}, "by_tool": {}}
    for group, items in probe.items():
        out["groups"][group] = {"n": len(items), "rows": [r.ref for _, r in items],
                                "before": agg(before[group]), "after": agg(after[group])}
    for tool in sorted({t for t, _ in probe[CORRECTED]}):
        idx = [i for i, (t, _) in enumerate(probe[CORRECTED]) if t == tool]
        out["by_tool"][tool] = {"n": len(idx), "before": agg([before[CORRECTED][i] for i in idx]),
                                "after": agg([after[CORRECTED][i] for i in idx])}
    out["verdict"] = verdict_line(out)
    return out


def verdict_line(unseen: dict[str, Any]) -> str:
    """One line: "rmdir: 0.20 -> 0.65 on 14 unseen calls; other tools 0.48 -> 0.47 on 120 (95% CI 0.39-0.56)"."""
    def rate(x: Any) -> str:
        return "n/a" if x is None else f"{x:.2f}"

    parts = [f"{tool}: {rate(v['before']['rehearse_exact'])} -> {rate(v['after']['rehearse_exact'])} on {v['n']} "
             f"unseen call{'s' if v['n'] != 1 else ''}" for tool, v in unseen["by_tool"].items()]
    if not parts:
        parts = ["no unseen call of the corrected tools in the held-out replays"]
    others = unseen["groups"].get(OTHERS, {})
    if others.get("n"):
        low, high = others["after"]["exact_interval"]
        parts.append(f"other tools {rate(others['before']['rehearse_exact'])} -> {rate(others['after']['rehearse_exact'])} "
                     f"on {others['n']} (after: 95% CI {low:.2f}-{high:.2f})")
    return "Rehearse exact, " + "; ".join(parts)


# ---------------------------------------------------------------- fix the tool, keep the rest


def _training_replays(seed: int) -> Iterator[tuple[Any, Episode]]:
    """(task, expert replay) of the BFCL `multi_turn_base` training split, the shipped adapter's own training
    data (`app.training.agent`), in a seeded order."""
    ids = envs.list_tasks("multi_turn_base", "train")
    random.Random(seed).shuffle(ids)
    for task_id in ids:
        task = envs.load_task(task_id)
        yield task, expert_episode(task)


def _replay_rows(task: Any, episode: Episode, ctx: PromptContext) -> list[Any]:
    """The rows `train-agent` builds from an expert replay (turns the judge passed), marked as replay."""
    ok = {t.turn for t in episode.turn_results if t.success}
    return episode_rows(episode, task, ctx, source=REPLAY_SOURCE, turns=ok, rehearse_all_turns=False)


def _calls(episode: Episode) -> dict[str, Any]:
    return {f"{episode.id}/{step.index}/{b.index}": b.call for step in episode.steps for b in step.branches
            if b.call is not None}


def training_sample(ctx: PromptContext, corrections: list[Any], ratio: float, tools: set[str],
                    trained: set[TransitionKey], selection: int,
                    seed: int = 0) -> tuple[list[Any], dict[str, list[tuple[str, Any]]]]:
    """(replay rows, validation calls) from expert replays of the BFCL training split, in a seeded task order.

    Replay: `round(ratio * k)` rows of each role the corrections have `k` rows of, sampled (seeded) from the
    rows the shipped adapter was trained on, never a Rehearse row of a trained call, in any state (it could
    contradict a correction). Validation: up to `selection` Rehearse rows per group (the corrected `tools`, the
    others), from the tasks after the replay's, never a trained transition nor a replay row's, each once; the
    checkpoints are measured on them, so the reported unseen calls (held-out split) play no part in choosing the
    steps.
    """
    rng = random.Random(seed)
    trained_call_keys = {c for c, _ in trained}
    want = {role: round(ratio * sum(r.role == role for r in corrections)) for role in ("act", "rehearse")}
    pool: dict[str, list[Any]] = {"act": [], "rehearse": []}
    picked: dict[str, list[tuple[str, Any]]] = {CORRECTED: [], OTHERS: []}
    seen: set[TransitionKey] = set(trained)  # the trained and the replay's transitions: never a validation call
    replays = _training_replays(seed)
    for task, episode in replays:  # the replay's tasks: until each role's pool holds 3x what it needs
        if all(len(pool[role]) >= 3 * n for role, n in want.items()):
            break
        calls = _calls(episode)
        for row in _replay_rows(task, episode, ctx):
            call = calls.get(row.ref)
            if row.role == "rehearse" and call is not None and canonical_call(call) in trained_call_keys:
                continue
            pool[row.role].append(row)
            if call is not None and row.role == "rehearse":
                seen.add((canonical_call(call), row.target))
    replay = [row for role, n in want.items() for row in rng.sample(pool[role], min(n, len(pool[role])))]
    if selection > 0:
        for task, episode in replays:  # the validation calls: later tasks, those with a wanted call only
            calls = _calls(episode)
            need = {g for g in picked if len(picked[g]) < selection and (g == OTHERS or tools)}
            if not need:
                break
            if not any((CORRECTED if c.name in tools else OTHERS) in need for c in calls.values()):
                continue
            for row in _replay_rows(task, episode, ctx):
                call = calls.get(row.ref)
                if row.role != "rehearse" or call is None:
                    continue
                key = (canonical_call(call), row.target)  # one transition once; `ls()` in another state is another
                group = CORRECTED if call.name in tools else OTHERS
                if key not in seen and len(picked[group]) < selection:
                    seen.add(key)
                    picked[group].append((call.name, row))
    return replay, picked


@dataclass
class Checkpoint:
    """The validation NLL of each group at one step (0: the parent, before training)."""

    step: int
    corrected_nll: float | None
    others_nll: float | None
    others_worse: bool = False


class EarlyStopping:
    """Keeps the best checkpoint and says when to stop.

    Best: the lowest validation NLL of the corrected tools among checkpoints where the other tools are not worse
    (their NLL at most `worse` above the parent's, as a share); with no validation call of the corrected tools,
    the latest such checkpoint. Stop: the other tools got worse, or `patience` checkpoints in a row were not
    better than the best."""

    def __init__(self, patience: int = PATIENCE, worse: float = CHECKPOINT_WORSE) -> None:
        self.patience, self.worse = patience, worse
        self.history: list[Checkpoint] = []
        self.best: Checkpoint | None = None
        self.stopped: str | None = None
        self._waiting = 0

    def add(self, step: int, corrected_nll: float | None, others_nll: float | None) -> tuple[bool, bool]:
        """Record a checkpoint; returns (it is the best so far, stop now)."""
        first = self.history[0] if self.history else None
        worse = (first is not None and others_nll is not None and first.others_nll is not None
                 and others_nll > first.others_nll * (1 + self.worse))
        point = Checkpoint(step, corrected_nll, others_nll, worse)
        self.history.append(point)
        if worse:
            self.stopped = (f"at step {step} the other tools' validation NLL rose from {first.others_nll:.3f} to "  # type: ignore[union-attr]
                            f"{others_nll:.3f} (more than {self.worse:.0%})")
            return False, True
        better = (self.best is None or corrected_nll is None or self.best.corrected_nll is None
                  or corrected_nll < self.best.corrected_nll)
        if better:
            self.best, self._waiting = point, 0
            return True, False
        self._waiting += 1
        if self._waiting >= self.patience:
            self.stopped = (f"at step {step} the corrected tools' validation NLL had not improved on step "
                            f"{self.best.step}'s for {self.patience} checkpoint(s)")  # type: ignore[union-attr]
            return False, True
        return False, False

    def summary(self) -> dict[str, Any]:
        return {"checkpoints": [asdict(c) for c in self.history], "best_step": self.best.step if self.best else None,
                "stopped_early": self.stopped, "patience": self.patience, "others_worse_share": self.worse}


def checkpoint_summary(cp: dict[str, Any]) -> str:
    """One line: the checkpoint kept and why training stopped (`metrics["checkpoints"]`)."""
    best = cp.get("best_step")
    kept = ("the parent's weights (step 0): no checkpoint improved the corrected tools without hurting the others"
            if best == 0 else f"step {best}")
    points = ", ".join(f"{c['step']}: {_nll(c['corrected_nll'])}/{_nll(c['others_nll'])}" for c in cp["checkpoints"])
    end = f"stopped early: {cp['stopped_early']}" if cp.get("stopped_early") else f"ran all {cp['trained_steps']} steps"
    return (f"Checkpoints every {cp['every']} steps, validation NLL corrected/other tools ({points}); kept {kept}; "
            f"{end}.")


def _nll(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def default_decision(metrics: dict[str, Any], worse_by: float = WORSE_BY) -> tuple[bool, str]:
    """(make the child the default, why): not when it is worse on the other tools' unseen calls (Rehearse exact
    down by more than `worse_by`), nor when that was not measured."""
    others = ((metrics.get("unseen") or {}).get("groups") or {}).get(OTHERS) or {}
    if not others.get("n"):
        return False, ("not made the default: it was not measured on unseen calls of the other tools "
                       "(set unseen calls above 0 to measure it)")
    before, after, n = others["before"]["rehearse_exact"], others["after"]["rehearse_exact"], others["n"]
    if after < before - worse_by - 1e-9:
        return False, (f"not made the default: worse on the other tools, Rehearse exact {before:.2f} -> {after:.2f} "
                       f"on {n} unseen calls (more than {worse_by:.2f} lower); the parent stays the default")
    return True, (f"made the default: other tools {before:.2f} -> {after:.2f} on {n} unseen calls "
                  f"(not more than {worse_by:.2f} lower)")


# ---------------------------------------------------------------- the run


def _registry_id(store: Store, path: Path | None) -> str | None:
    """The registry id of an adapter directory, else its path (None for the base weights)."""
    if path is None:
        return None
    resolved = str(Path(path).resolve())
    return store.adapter_id(resolved) or resolved


def run_finetune(store: Store, req: FinetuneRequest, progress: Callable[[Any], None] | None = None,
                 _save_hook: Callable[[Path], None] | None = None) -> FinetuneResult:
    """Fine-tune on the selected corrections and register the new adapter (see the module docstring)."""
    from model_backend import AdapterError, load_model
    from model_backend.loading import MissingModelError
    from model_backend.training import TrainConfig, TrainingError, encode_rows, save_adapter, train, trainable_model

    validate_request(req)
    selected = select_corrections(store, req.episodes, req.annotated)
    started = utcnow()
    try:
        loaded = load_model(req.spec, adapter=req.parent)
    except (AdapterError, MissingModelError, ValueError) as exc:
        raise FinetuneError(str(exc).splitlines()[0]) from None
    tok = loaded.tokenizer
    ctx = PromptContext(lambda text: len(tok.encode(text, add_special_tokens=False)),
                        int(getattr(loaded.model.config, "max_position_embeddings", 8192)))
    notes: list[str] = []
    rows = build_rows(store, selected, ctx, notes)
    if not rows:
        raise FinetuneError("the selected branches give no training rows "
                            + (f"({notes[0]})" if notes else "(no call or real response to learn from)"))
    config = TrainConfig(steps=req.steps, lr=req.lr, rank=req.rank, seed=req.seed, warmup_steps=min(5, req.steps),
                         max_seq_len=None, pack_len=None)  # type: ignore[arg-type]
    tools, calls = trained_calls(store, selected)
    replay: list[Any] = []
    selection: dict[str, list[tuple[str, Any]]] = {CORRECTED: [], OTHERS: []}
    if req.replay_ratio > 0 or req.eval_every > 0:
        replay, selection = training_sample(ctx, rows, req.replay_ratio, tools, calls,
                                            req.selection_rows if req.eval_every else 0, req.seed)
    encoded, dropped = encode_rows(tok, rows + replay)
    held = heldout_rows(ctx, req.heldout_rows, req.seed)
    probe: dict[str, list[tuple[str, Any]]] = {}
    if req.unseen_rows:
        probe = unseen_probe(ctx, tools, calls, req.unseen_rows, req.seed)
    policy = measuring_policy(loaded, loaded.model)
    before = correction_metrics(policy, tok, rows, req.measure_agreement)
    held_before = correction_metrics(policy, tok, held, req.measure_agreement) if held else None
    probe_before = {g: rehearse_scores(policy, tok, [r for _, r in items]) for g, items in probe.items()}
    try:
        model = trainable_model(loaded, config)
        t0 = time.perf_counter()
        stopper = EarlyStopping(req.patience) if req.eval_every else None
        checkpoint = _Checkpoints(model, tok, selection, stopper) if stopper is not None else None
        result = train(model, encoded, config, progress=progress, dropped=len(dropped),
                       checkpoint_every=req.eval_every, checkpoint=checkpoint)
        if checkpoint is not None:
            checkpoint.restore()  # the best checkpoint is the adapter
    except TrainingError as exc:
        raise FinetuneError(str(exc)) from None
    del policy  # the parent's inference copy
    policy = measuring_policy(loaded, model)
    after = correction_metrics(policy, tok, rows, req.measure_agreement)
    held_after = correction_metrics(policy, tok, held, req.measure_agreement) if held else None
    probe_after = {g: rehearse_scores(policy, tok, [r for _, r in items]) for g, items in probe.items()}
    parent_id = _registry_id(store, req.parent)
    data = {"db": store.path, "annotations": [s.annotation_id for s in selected],
            "branches": [s.branch_id for s in selected], "episodes": sorted({s.episode_id for s in selected}),
            "rows": {"act": sum(r.role == "act" for r in rows), "rehearse": sum(r.role == "rehearse" for r in rows),
                     "replay_act": sum(r.role == "act" for r in replay),
                     "replay_rehearse": sum(r.role == "rehearse" for r in replay)},
            "replay_ratio": req.replay_ratio, "replay": [r.ref for r in replay], "left_out": notes}
    metrics = {"before": before, "after": after, "train": result.summary(), "seconds": round(time.perf_counter() - t0, 1)}
    if stopper is not None:
        metrics["checkpoints"] = {**stopper.summary(), "every": req.eval_every, "trained_steps": result.steps,
                                  "validation": {g: [r.ref for _, r in items] for g, items in selection.items()}}
    if held:
        metrics["heldout"] = {"rows": [r.ref for r in held], "before": held_before, "after": held_after}
    if probe:
        metrics["unseen"] = summarize_unseen(probe, probe_before, probe_after)
        metrics["verdict"] = metrics["unseen"]["verdict"]
    made_default, reason = default_decision(metrics, req.worse_by)
    metrics["default"] = {"made_default": made_default, "reason": reason, "worse_by": req.worse_by}
    adapter_id = uuid.uuid4().hex[:12]
    card = {"adapter_id": adapter_id, "parent": parent_id, "data": data, "metrics": metrics,
            "config": result.config}
    out = save_adapter(model, req.out, {"finetune.json": json.dumps(card, indent=2, default=str)},
                       _after_write=_save_hook)
    try:
        run_id = _register(store, adapter_id, out, parent_id, data, metrics, result, started, req)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)  # registry unchanged: the adapter must not linger unregistered
        raise
    return FinetuneResult(adapter_id, out, run_id, parent_id, data, result.losses, metrics)


class _Checkpoints:
    """`train`'s checkpoint callback: the validation NLL of each group, the best LoRA weights kept in memory."""

    def __init__(self, model: Any, tokenizer: Any, selection: dict[str, list[tuple[str, Any]]],
                 stopper: EarlyStopping) -> None:
        from model_backend.training import encode_rows

        self.model, self.stopper = model, stopper
        self.encoded = {g: encode_rows(tokenizer, [r for _, r in items])[0] for g, items in selection.items()}
        self.best: dict[str, Any] = {}
        self(0)  # the parent: what every checkpoint is compared with

    def _nll(self, group: str) -> float | None:
        from model_backend.training import nll_of_rows

        rows = self.encoded.get(group) or []
        return round(sum(nll_of_rows(self.model, rows)) / len(rows), 4) if rows else None

    def __call__(self, step: int) -> bool:
        is_best, stop = self.stopper.add(step, self._nll(CORRECTED), self._nll(OTHERS))
        if is_best:
            self.best = {n: p.detach().clone() for n, p in self.model.named_parameters() if p.requires_grad}
        return stop

    def restore(self) -> None:
        import torch

        with torch.no_grad():
            for name, param in self.model.named_parameters():
                if name in self.best:
                    param.copy_(self.best[name])


def measuring_policy(loaded: Any, model: Any) -> Any:
    """The policy that measures greedy Rehearse and Act outputs before and after a fine-tune: decoding as the app
    does, on an inference copy of `model` (its LoRA folded into a copy of the weights, fp16 linear layers on a
    CPU, the native decode step where the CPU has one). Decoding through the training model itself (fp32, the
    LoRA unmerged, the torch step) took 0.24 s a token at batch 8, most of a fine-tune's wall time. The before/after
    NLL is scored here too, on the prompts' KV each decode leaves in the prefix cache (`rehearse_measure`); the
    checkpoints' validation NLL is measured on the training model (`nll_of_rows`). `model` is never changed."""
    import copy

    from model_backend.loading import INFERENCE_WEIGHTS, LoadedModel, quantize_linears, weights_format
    from model_backend.policy import TransformersPolicy

    merged = copy.deepcopy(model)
    if hasattr(merged, "merge_and_unload"):  # a PEFT model (any LoRA); a bare model is used as it is
        merged = merged.merge_and_unload()
    merged.eval()
    weights = weights_format(default=INFERENCE_WEIGHTS) if loaded.device.type == "cpu" else "fp32"  # as load_policy
    if weights != "fp32":
        merged = quantize_linears(merged, weights)
    copy_ = LoadedModel(merged, loaded.tokenizer, loaded.spec, loaded.device, loaded.dtype, 0.0, False,
                        adapter="(measured)")
    copy_.weights = weights
    return TransformersPolicy(copy_, score_memo=0)


def _register(store: Store, adapter_id: str, out: Path, parent: str | None, data: dict[str, Any],
              metrics: dict[str, Any], result: Any, started: str, req: FinetuneRequest) -> int:
    config = {**asdict(req), "out": str(req.out), "parent": str(req.parent) if req.parent else None}
    decision = metrics.get("default") or {}
    return store.register_finetune(
        {"id": adapter_id, "path": str(out.resolve()), "parent": parent, "base_model": req.spec,
         "data": json.dumps(data), "metrics": json.dumps(metrics), "created_at": utcnow(),
         "default_reason": decision.get("reason")},
        {"adapter_id": adapter_id, "parent": parent, "status": "finished", "config": json.dumps(config),
         "data": json.dumps(data), "losses": json.dumps([round(x, 5) for x in result.losses]),
         "metrics": json.dumps(metrics), "started_at": started, "finished_at": utcnow(), "error": None},
        make_default=bool(decision.get("made_default")))  # one default at a time; a refused child leaves the parent's


__all__ = ["CORRECTED", "EVAL_EVERY", "OTHERS", "REPLAY_RATIO", "Checkpoint", "EarlyStopping", "checkpoint_summary",
           "default_decision", "training_sample", "FinetuneError", "FinetuneRequest", "FinetuneResult", "Selected",
           "build_rows", "correction_metrics", "rehearse_measure", "rehearse_scores", "target_nll", "summarize_unseen",
           "trained_calls", "unseen_probe", "verdict_line", "wilson", "heldout_rows", "run_finetune",
           "select_corrections", "validate_request"]
