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
                config = GenerationConfig(max_new_tokens=enc.n_target + 8, temperature=0.0, stop=REHEARSE_STOP)
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
    policy = TransformersPolicy(loaded)
    before = correction_metrics(policy, loaded.model, tok, rows, req.measure_agreement)
    held_before = correction_metrics(policy, loaded.model, tok, held, req.measure_agreement) if held else None
    try:
        model = trainable_model(loaded, config)
        t0 = time.perf_counter()
        result = train(model, encoded, config, progress=progress, dropped=len(dropped))
    except TrainingError as exc:
        raise FinetuneError(str(exc)) from None
    policy = TransformersPolicy(_with_model(loaded, model))
    after = correction_metrics(policy, model, tok, rows, req.measure_agreement)
    held_after = correction_metrics(policy, model, tok, held, req.measure_agreement) if held else None
    parent_id = _registry_id(store, req.parent)
    data = {"db": store.path, "annotations": [s.annotation_id for s in selected],
            "branches": [s.branch_id for s in selected], "episodes": sorted({s.episode_id for s in selected}),
            "rows": {"act": sum(r.role == "act" for r in rows), "rehearse": sum(r.role == "rehearse" for r in rows)},
            "left_out": notes}
    metrics = {"before": before, "after": after, "train": result.summary(), "seconds": round(time.perf_counter() - t0, 1)}
    if held:
        metrics["heldout"] = {"rows": [r.ref for r in held], "before": held_before, "after": held_after}
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


__all__ = ["FinetuneError", "FinetuneRequest", "FinetuneResult", "Selected", "build_rows", "correction_metrics",
           "heldout_rows", "run_finetune", "select_corrections", "validate_request"]
