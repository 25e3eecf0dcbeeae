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
from typing import Any, Callable

from app import envs
from app.formats import REHEARSE_STOP, canonical_call, canonical_json, parse_action, parse_result
from app.records import Annotation, utcnow
from app.store import Store
from app.training.rows import CorrectionError, PromptContext, correction_rows, expert_rows, parse_corrected_action

log = logging.getLogger(__name__)

MAX_STEPS = 10_000
MAX_HELDOUT_ROWS = 64
HELDOUT_TASKS = 4
"""Held-out tasks whose expert replays the held-out sample is drawn from (enough rows, still fast)."""
MAX_UNSEEN_ROWS = 200
UNSEEN_TASKS = 50
"""Held-out tasks whose expert replays the unseen calls are drawn from (every one of their real transitions)."""
CORRECTED, OTHERS = "corrected tools", "other tools"


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
    if Path(req.out).exists():
        raise FinetuneError(f"--out {req.out} already exists; choose a new directory")
    if req.parent is not None and not is_adapter_dir(req.parent):
        raise FinetuneError(f"parent {req.parent} is not a LoRA adapter directory "
                            "(needs adapter_config.json and adapter weights)")


def select_corrections(store: Store, episodes: list[str] | None = None, annotated: bool = False) -> list[Selected]:
    """Annotated branches with a correction (and, with `annotated`, those without one),
    the latest annotation per branch; corrections are validated here."""
    sql = ("select a.id as aid, a.*, b.episode_id, b.step_idx, b.idx as bidx from annotations a "
           "join branches b on b.id = a.branch_id order by a.id")
    latest: dict[int, dict[str, Any]] = {}
    for row in store.db.query(sql):
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
            close = getattr(env, "close", None)
            if close is not None:
                close()
    for note in notes[start:]:
        log.warning("left out of training: %s", note)
    return rows


# ---------------------------------------------------------------- metrics


def rehearse_budget(enc: Any) -> int:
    """The token budget of a measured Rehearse generation: as the runner's (128) or the target's length plus room
    for the tags; never so tight that the constraint's budget closing (`constrain.CLOSE_MARGIN`) cuts the value
    short (with `n_target + 8`, `{"current_working_directory": "deep_folder"}` came out as `"deep_"`)."""
    return max(128, enc.n_target + 32)


def correction_metrics(policy: Any, model: Any, tokenizer: Any, rows: list[Any], agreement: bool) -> dict[str, Any]:
    """NLL of the corrected responses under Rehearse, and Act agreement with the corrected actions."""
    from model_backend.base import GenerationConfig
    from model_backend.training import encode_rows, nll_of_rows

    out: dict[str, Any] = {}
    rehearse = [r for r in rows if r.role == "rehearse"]
    if rehearse:
        encoded, _ = encode_rows(tokenizer, rehearse)
        nll = nll_of_rows(model, encoded)
        out["rehearse_nll"] = round(sum(nll) / len(nll), 4)
        out["rehearse_nll_rows"] = [round(x, 4) for x in nll]
        if agreement:
            exact = 0
            for row, enc in zip(rehearse, encoded):
                config = GenerationConfig(max_new_tokens=rehearse_budget(enc), temperature=0.0, stop=REHEARSE_STOP)
                predicted, error = parse_result(policy.rehearse([row.prompt], config)[0].text)
                exact += error is None and canonical_json(predicted) == canonical_json(parse_result(row.target)[0])
            out["rehearse_exact"] = round(exact / len(rehearse), 4)
    act = [r for r in rows if r.role == "act"]
    if act:
        encoded, _ = encode_rows(tokenizer, act)
        out["act_nll"] = round(sum(nll_of_rows(model, encoded)) / len(encoded), 4)
        if agreement:
            agree = 0
            for row, enc in zip(act, encoded):
                config = GenerationConfig(max_new_tokens=enc.n_target + 8, temperature=0.0, stop=("</tool_call>",))
                text = policy.act(row.prompt, 1, config)[0].text
                agree += _same_action(text, row.prompt.prefill + row.target)
            out["act_agreement"] = round(agree / len(act), 4)
    return out


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


def trained_calls(store: Store, selected: list[Selected]) -> tuple[set[str], set[str]]:
    """(tools, canonical calls) the corrections train on: each corrected branch's call, or its corrected call."""
    tools, calls = set(), set()
    for s in selected:
        _, branch = store.get_branch(s.branch_id)
        call = branch.call if branch.kind == "call" else None
        if (s.annotation.corrected_action or "").strip():
            fixed = parse_corrected_action(s.annotation, s.annotation_id)
            if fixed.call is not None:
                tools.add(fixed.call.name)
                calls.add(canonical_call(fixed.call))
        if call is not None and (s.annotation.corrected_predicted_set or not s.annotation.corrected):
            tools.add(call.name)
            calls.add(canonical_call(call))
    return tools, calls


def unseen_probe(ctx: PromptContext, tools: set[str], trained: set[str], n: int, seed: int = 0,
                 task_ids: list[str] | None = None) -> dict[str, list[tuple[str, Any]]]:
    """Rehearse rows of real transitions never trained on, as {group: [(tool, row)]}: up to `n` calls of the
    corrected `tools` and a fixed sample of `n` calls of the other tools, from the expert replays of the first
    `UNSEEN_TASKS` held-out BFCL tasks (never trained on; the same rows for every fine-tune with the same seed).
    A call equal to a trained one (`trained`, canonical) is not unseen and is left out."""
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
        key = canonical_call(call)
        if key in trained or key in seen:
            continue  # a trained call is not unseen; a repeated one counts once
        seen.add(key)
        pool[CORRECTED if call.name in tools else OTHERS].append((call.name, row))
    rng = random.Random(seed)
    return {group: (items if len(items) <= n else rng.sample(items, n)) for group, items in pool.items()}


def rehearse_scores(policy: Any, model: Any, tokenizer: Any, rows: list[Any]) -> list[tuple[bool, float]]:
    """(greedy Rehearse output equals the target, NLL of the target) of each Rehearse row."""
    from model_backend.base import GenerationConfig
    from model_backend.training import encode_rows, nll_of_rows

    if not rows:
        return []
    encoded, _ = encode_rows(tokenizer, rows)
    nll = nll_of_rows(model, encoded)
    out = []
    for row, enc, loss in zip(rows, encoded, nll):
        config = GenerationConfig(max_new_tokens=rehearse_budget(enc), temperature=0.0, stop=REHEARSE_STOP)
        predicted, error = parse_result(policy.rehearse([row.prompt], config)[0].text)
        out.append((error is None and canonical_json(predicted) == canonical_json(parse_result(row.target)[0]),
                    float(loss)))
    return out


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


# ---------------------------------------------------------------- the run


def _registry_id(store: Store, path: Path | None) -> str | None:
    """The registry id of an adapter directory, else its path (None for the base weights)."""
    if path is None:
        return None
    resolved = str(Path(path).resolve())
    for row in store.db.query("select id from adapters where path = ?", [resolved]):
        return str(row["id"])
    return resolved


def run_finetune(store: Store, req: FinetuneRequest, progress: Callable[[Any], None] | None = None,
                 _save_hook: Callable[[Path], None] | None = None) -> FinetuneResult:
    """Fine-tune on the selected corrections and register the new adapter (see the module docstring)."""
    from model_backend import AdapterError, load_model
    from model_backend.loading import MissingModelError
    from model_backend.policy import TransformersPolicy
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
    encoded, dropped = encode_rows(tok, rows)
    held = heldout_rows(ctx, req.heldout_rows, req.seed)
    probe: dict[str, list[tuple[str, Any]]] = {}
    if req.unseen_rows:
        tools, calls = trained_calls(store, selected)
        probe = unseen_probe(ctx, tools, calls, req.unseen_rows, req.seed)
    policy = TransformersPolicy(loaded)
    before = correction_metrics(policy, loaded.model, tok, rows, req.measure_agreement)
    held_before = correction_metrics(policy, loaded.model, tok, held, req.measure_agreement) if held else None
    probe_before = {g: rehearse_scores(policy, loaded.model, tok, [r for _, r in items]) for g, items in probe.items()}
    try:
        model = trainable_model(loaded, config)
        t0 = time.perf_counter()
        result = train(model, encoded, config, progress=progress, dropped=len(dropped))
    except TrainingError as exc:
        raise FinetuneError(str(exc)) from None
    policy = TransformersPolicy(_with_model(loaded, model))
    after = correction_metrics(policy, model, tok, rows, req.measure_agreement)
    held_after = correction_metrics(policy, model, tok, held, req.measure_agreement) if held else None
    probe_after = {g: rehearse_scores(policy, model, tok, [r for _, r in items]) for g, items in probe.items()}
    parent_id = _registry_id(store, req.parent)
    data = {"db": store.path, "annotations": [s.annotation_id for s in selected],
            "branches": [s.branch_id for s in selected], "episodes": sorted({s.episode_id for s in selected}),
            "rows": {"act": sum(r.role == "act" for r in rows), "rehearse": sum(r.role == "rehearse" for r in rows)},
            "left_out": notes}
    metrics = {"before": before, "after": after, "train": result.summary(), "seconds": round(time.perf_counter() - t0, 1)}
    if held:
        metrics["heldout"] = {"rows": [r.ref for r in held], "before": held_before, "after": held_after}
    if probe:
        metrics["unseen"] = summarize_unseen(probe, probe_before, probe_after)
        metrics["verdict"] = metrics["unseen"]["verdict"]
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


def _with_model(loaded: Any, model: Any) -> Any:
    from model_backend.loading import LoadedModel

    return LoadedModel(model, loaded.tokenizer, loaded.spec, loaded.device, loaded.dtype, 0.0, False,
                       adapter="(fine-tuned)")


def _register(store: Store, adapter_id: str, out: Path, parent: str | None, data: dict[str, Any],
              metrics: dict[str, Any], result: Any, started: str, req: FinetuneRequest) -> int:
    config = {**asdict(req), "out": str(req.out), "parent": str(req.parent) if req.parent else None}
    with store._lock, store._atomic():
        store.db["adapters"].insert({"id": adapter_id, "path": str(out.resolve()), "parent": parent,
                                     "base_model": req.spec, "data": json.dumps(data),
                                     "metrics": json.dumps(metrics), "created_at": utcnow()})
        return int(store.db["finetune_runs"].insert({
            "adapter_id": adapter_id, "parent": parent, "status": "finished", "config": json.dumps(config),
            "data": json.dumps(data), "losses": json.dumps([round(x, 5) for x in result.losses]),
            "metrics": json.dumps(metrics), "started_at": started, "finished_at": utcnow(), "error": None,
        }).last_pk)


__all__ = ["CORRECTED", "OTHERS", "FinetuneError", "FinetuneRequest", "FinetuneResult", "Selected", "build_rows",
           "correction_metrics", "rehearse_scores", "summarize_unseen", "trained_calls", "unseen_probe", "verdict_line",
           "wilson", "heldout_rows", "run_finetune", "select_corrections", "validate_request"]
