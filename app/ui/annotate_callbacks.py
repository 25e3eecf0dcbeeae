"""Callbacks of the Annotate tab: a review queue of stored branches, labels and corrections."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import gradio as gr

from app.service import InputError, Services, branch_use_note, save_annotation
from app.store import StoreError
from app.ui import constants as C
from app.ui import render
from app.ui.run_callbacks import message_html
from app.ui.traces_callbacks import choice


@dataclass
class ReviewQueue:
    """One session's queue: branch row ids under the current filters and the position in them."""

    ids: list[int] = field(default_factory=list)
    pos: int = 0

    @property
    def current(self) -> int | None:
        return self.ids[self.pos] if 0 <= self.pos < len(self.ids) else None


AnnotateView = tuple[str, str, str, str, Any, Any, Any, Any, Any]
"""message, header, branch card, existing annotations, label, corrected predicted, corrected action, note,
plain answer."""


class AnnotateCallbacks:
    def __init__(self, services: Services) -> None:
        self.services = services

    def filter_choices(self) -> tuple[Any, Any]:
        store = self.services.store
        return (gr.Dropdown(choices=[C.ALL] + store.branch_tools()),
                gr.Dropdown(choices=[C.ALL] + [r["id"] for r in store.find_episodes(limit=500)]))

    def load_queue(self, queue: ReviewQueue, diverged: bool, unannotated: bool, tool: str,
                   episode: str) -> AnnotateView:
        rows = self.services.store.annotation_queue(diverged=bool(diverged), unannotated=bool(unannotated),
                                                    tool=choice(tool), episode_id=choice(episode))
        queue.ids, queue.pos = [r["id"] for r in rows], 0
        note = f"{len(rows)} branch(es) to review." if rows else "No branch matches these filters."
        return self.show(queue, message_html(note))

    def show(self, queue: ReviewQueue, message: str = "") -> AnnotateView:
        branch_id = queue.current
        if branch_id is None:
            return (message, "Queue empty: run some steps, or loosen the filters, then Load queue.",
                    render.branch_cards(None, "Nothing to review."), "", None, "", "", "", False)
        try:
            row, branch = self.services.store.get_branch(branch_id)
        except StoreError as exc:
            return (message_html(str(exc), "error"), "", "", "", None, "", "", "", False)
        header = (f"**Branch {queue.pos + 1} of {len(queue.ids)}** · id {branch_id} · episode "
                  f"{render.md_code(row['episode_id'])} · step {row['step_idx']} · branch b{row['idx']} · task "
                  f"{render.md_code(row['task_id'])} · mode {render.md_text(str(row['mode']))}")
        use = branch_use_note(row["task_id"])
        if use:
            header += f"\n\n{render.md_text(use)}"
        existing = self.services.store.annotation_records(branch_id)
        # Names, notes and corrections come from other people (and imported files): literal text only.
        lines = [f"- {render.md_text(a.created_at[:19])} · **{render.md_text(a.label or '(no label)')}** "
                 f"by {render.md_text(a.annotator)}"
                 + (f" · corrected response {render.md_code(render.short(json.dumps(a.corrected_predicted, ensure_ascii=False), 80))}"
                    if a.corrected_predicted_set else "")
                 + (f" · corrected {'answer' if a.corrected_action_kind == 'answer' else 'action'} "
                    f"{render.md_code(render.short(a.corrected_action, 80))}" if a.corrected_action else "")
                 + (f" · {render.md_text(' '.join(a.note.split()))}" if a.note else "") for a in existing]
        existing_md = ("**Earlier annotations**\n" + "\n".join(lines)) if lines else "_No annotation yet._"
        return (message, header, '<div class="ea-cards">' + render.branch_card(branch, row["state_before"]) + "</div>", existing_md,
                None, "", "", "", False)

    def move(self, queue: ReviewQueue, delta: int) -> AnnotateView:
        if queue.ids:
            queue.pos = min(max(queue.pos + delta, 0), len(queue.ids) - 1)
        return self.show(queue)

    def prev(self, queue: ReviewQueue) -> AnnotateView:
        return self.move(queue, -1)

    def next(self, queue: ReviewQueue) -> AnnotateView:
        return self.move(queue, +1)

    def save(self, queue: ReviewQueue, label: str | None, corrected_predicted: str, corrected_action: str,
             note: str, annotator: str, answer: bool = False) -> AnnotateView:
        """Validate, save, go to the next branch; on a mistake keep every field as typed."""
        keep = (gr.skip(),) * 8
        branch_id = queue.current
        if branch_id is None:
            return (message_html("Nothing to annotate: load the queue first.", "error"), *keep)
        try:
            result = save_annotation(self.services.store, branch_id, label, corrected_predicted, corrected_action,
                                     note, annotator, answer=bool(answer), remember=self.services.remember)
        except (InputError, StoreError) as exc:
            gr.Warning(str(exc))
            return (message_html(str(exc), "error"), *keep)
        annotation = result.annotation
        saved = f"Saved annotation {result.id} ({annotation.label or 'no label'}) on branch {branch_id}."
        if result.remembered is not None:
            saved += (f" Its corrected response of {result.remembered.tool} is in the rehearsal memory now: the "
                      "next rehearsal of that call retrieves it (with memory on).")
        if queue.pos < len(queue.ids) - 1:
            queue.pos += 1
        else:
            saved += " That was the last branch of the queue."
        return self.show(queue, message_html(saved))

    def use_actual(self, queue: ReviewQueue) -> Any:
        """Start a correction from the actual response (what the tool really returned)."""
        if queue.current is None:
            return gr.skip()
        _, branch = self.services.store.get_branch(queue.current)
        return json.dumps(branch.actual, indent=1, sort_keys=True, ensure_ascii=False) \
            if branch.actual_source else gr.skip()

    @staticmethod
    def remembered_annotator(remembered: str | None, current: str | None) -> Any:
        """The name this browser used last, where the field is empty (a typed or signed-in name stays)."""
        return remembered if (remembered or "").strip() and not (current or "").strip() else gr.skip()

    @staticmethod
    def annotator_from_login(profile: gr.OAuthProfile | None) -> Any:
        """The Spaces login's user name when someone is signed in; otherwise leave the field alone."""
        if profile is None:
            return gr.skip()
        return getattr(profile, "username", None) or profile.get("preferred_username") or gr.skip()
