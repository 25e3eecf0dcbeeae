"""Callbacks of the Fine-tune tab: preview the corrected data, fine-tune with a live loss, show before/after.

Thin by design: selection, validation, training and registration are `app.training.finetune`'s
(through `app.service.finetune`, which also runs the job in a worker thread and builds the figures); here are
only the translations between them and Gradio.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, Iterator

import gradio as gr

from app.config import shipped_adapter
from app.service import InputError, Services, annotated_episode_choices, finetune
from app.service.finetune import FinetuneError, FinetuneResult, checkpoint_summary, validate_request
from app.store import StoreError
from app.ui import constants as C
from app.ui import render
from app.ui.run_callbacks import message_html

PREVIEW_COLUMNS = ["Annotation", "Branch", "Episode", "Step", "Branch #", "Label", "Correction", "Act rows",
                   "Rehearse rows"]
PlanView = tuple[str, str, Any]
"""message, summary, table of the branches to train on."""
FinetuneView = tuple[Any, ...]
"""message, status, loss figure, before/after rows, before/after figure, parent choices, adapter name,
the Run tab's adapter dropdown."""


class FinetuneCallbacks:
    def __init__(self, services: Services, run_adapter_choices: Callable[[], Any],
                 adapter_root: Path | None = None) -> None:
        self.services = services
        self.run_adapter_choices = run_adapter_choices
        """The Run tab's refresh of its adapter dropdown (a new adapter must become selectable there)."""
        self.adapter_root = Path(adapter_root or finetune.ADAPTER_ROOT)

    # ------------------------------------------------------------ choices

    def parent_choices(self) -> list[str]:
        shipped = shipped_adapter()
        return ([C.PARENT_SHIPPED] if shipped else []) + [C.PARENT_NONE] + \
            [a for a in self.services.adapters() if a != shipped]

    def default_parent(self) -> str:
        """The default adapter: the fine-tuned one made the default, else the shipped one, else none."""
        made = self.services.store.default_adapter()
        return made or (C.PARENT_SHIPPED if shipped_adapter() else C.PARENT_NONE)

    def refresh(self) -> tuple[Any, Any]:
        """Episodes with annotations, and the parents (a fine-tune in another session may have added one)."""
        return (gr.Dropdown(choices=annotated_episode_choices(self.services.store)),
                gr.Dropdown(choices=self.parent_choices()))

    # ------------------------------------------------------------ data

    def preview(self, episodes: list[str] | None, annotated: bool) -> PlanView:
        """The Preview button: the branches and rows a fine-tune would use (a warning when none)."""
        return self._plan_view(episodes, annotated, warn=True)

    def show_plan(self, episodes: list[str] | None, annotated: bool) -> PlanView:
        """The same, quietly, when the tab opens or a filter changes."""
        return self._plan_view(episodes, annotated, warn=False)

    def _plan_view(self, episodes: list[str] | None, annotated: bool, warn: bool) -> PlanView:
        try:
            plan = finetune.plan(self.services.store, episodes or None, bool(annotated))
        except (FinetuneError, StoreError) as exc:
            if warn:
                gr.Warning(str(exc))
            return message_html(str(exc), "error"), "**No training data** with these filters.", []
        rows = [[b.selected.annotation_id, b.selected.branch_id, b.selected.episode_id, b.selected.step_idx,
                 b.selected.branch_idx, b.selected.annotation.label or "", b.correction, b.act_rows,
                 b.rehearse_rows] for b in plan.branches]
        return "", plan_summary(plan), rows

    # ------------------------------------------------------------ the fine-tune

    def run(self, episodes: list[str] | None, annotated: bool, steps: Any, lr: Any, rank: Any, parent: str | None,
            name: str, heldout_rows: Any, agreement: bool, unseen_rows: Any = 0, replay_ratio: Any = 0,
            eval_every: Any = 0, progress=gr.Progress()) -> Iterator[FinetuneView]:
        """Validate, start the job (one at a time), stream the loss, then show before/after."""
        skip = gr.skip()
        try:
            req = finetune.build_request(
                episodes=episodes, annotated=annotated, steps=steps, lr=lr, rank=rank,
                parent=finetune.parent_path(parent, C.PARENT_SHIPPED, C.PARENT_NONE),
                out=finetune.adapter_dir(name, self.adapter_root), heldout_rows=heldout_rows, agreement=agreement,
                max_steps=C.FT_MAX_STEPS, unseen_rows=unseen_rows, replay_ratio=replay_ratio, eval_every=eval_every)
            validate_request(req)  # the parent is an adapter, the directory is new
            plan = finetune.plan(self.services.store, req.episodes, req.annotated)  # nothing selected, bad JSON
            job = finetune.start(self.services.store, req)
        except (InputError, FinetuneError, StoreError) as exc:
            gr.Warning(str(exc))
            yield (message_html(f"{exc} Nothing was changed.", "error"), *(skip,) * 7)
            return
        what = (f"{plan_summary(plan)} Parent: {parent or C.PARENT_NONE}; new adapter: `{req.out}`; "
                f"{'at most ' if req.eval_every else ''}{req.steps} steps at learning rate {req.lr:g}"
                + (f", {req.replay_ratio:g} replay row(s) per correction row" if req.replay_ratio else "")
                + (f", a checkpoint every {req.eval_every} steps" if req.eval_every else "") + ".")
        started = time.perf_counter()
        progress(0.0, desc="Loading the model and measuring the examples before training")
        yield (message_html("Fine-tuning… the model trains on this machine's CPU."),
               f"{what}\n\nLoading the model and measuring before…", finetune.loss_figure([], req.steps), [],
               finetune.comparison_figure({}), skip, skip, skip)
        losses: list[float] = []
        for event in job.events(C.FT_POLL_S):
            if event is None:
                continue
            if event.progress is not None:
                p = event.progress
                losses.append(float(p.loss))
                done = p.step >= p.steps
                desc = ("Measuring after and saving the adapter" if done
                        else f"Training: step {p.step}/{p.steps}, loss {p.loss:.3f}")
                progress((p.step, p.steps), desc=desc, unit="steps")
                yield (skip, f"{what}\n\n{desc} ({time.perf_counter() - started:.0f} s)…",
                       finetune.loss_figure(losses, req.steps), skip, skip, skip, skip, skip)
            elif event.error is not None:
                text = (f"The fine-tune failed: {event.error}. Nothing was changed: no adapter was registered "
                        "and the parent is untouched.")
                gr.Warning(text)
                yield (message_html(text, "error"), what, finetune.loss_figure(losses, req.steps), skip, skip,
                       skip, skip, skip)
            else:
                yield self._finished(event.result, what)

    def _finished(self, result: FinetuneResult | None, what: str) -> FinetuneView:
        assert result is not None
        train = result.metrics.get("train", {})
        decision = result.metrics.get("default") or {}
        made = bool(decision.get("made_default"))
        text = (f"Adapter {result.adapter_id} saved to {result.path} and registered (parent: "
                f"{result.parent or 'base weights'}). It is now in the Run tab's Adapter list; "
                f"{decision.get('reason', 'not made the default')}.")
        status = (f"{what}\n\n**Done** in {result.metrics.get('seconds', '?')} s of training: "
                  f"{train.get('steps', len(result.losses))} steps, loss {train.get('loss_first')} → "
                  f"{train.get('loss_last')}, {train.get('tokens_per_s')} tokens/s.")
        if result.metrics.get("verdict"):  # on calls it never saw: did it fix the tool, and keep the rest?
            status += f"\n\n**{render.md_text(result.metrics['verdict'])}**"
        if result.metrics.get("checkpoints"):
            status += f"\n\n{render.md_text(checkpoint_summary(result.metrics['checkpoints']))}"
        status += f"\n\n**Default adapter**: {render.md_text(decision.get('reason', 'not made the default'))}."
        run_adapter = self.run_adapter_choices()
        if made:  # the Run tab starts from it now
            run_adapter = gr.Dropdown(choices=[C.NO_ADAPTER] + self.services.adapters(),
                                      value=str(Path(result.path).resolve()))
        return (message_html(text, "info" if made else "warning"), status, finetune.loss_figure(result.losses, len(result.losses)),
                finetune.comparison_rows(result.metrics), finetune.comparison_figure(result.metrics),
                gr.Dropdown(choices=self.parent_choices(), value=self.default_parent()), finetune.default_name(),
                run_adapter)


def plan_summary(plan: finetune.Plan) -> str:
    n = len(plan.branches)
    text = (f"**{n} branch{'es' if n != 1 else ''}** → {plan.act_rows} Act row(s) and "
            f"{plan.rehearse_rows} Rehearse row(s) (episodes: "
            f"{render.short(', '.join(sorted({b.selected.episode_id for b in plan.branches})), 120)}).")
    if plan.left_out:  # the rest trains; say what does not, as literal text
        text += f"\n\n**Left out** ({len(plan.left_out)}): " + "; ".join(render.md_text(n) for n in plan.left_out[:5]) \
            + (f"; and {len(plan.left_out) - 5} more" if len(plan.left_out) > 5 else "")
    return text
