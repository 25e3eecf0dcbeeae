"""Callbacks of the Traces tab: list stored episodes, replay one read-only, compare two."""
from __future__ import annotations

import re
import tempfile
from pathlib import Path
from typing import Any

import gradio as gr

from app.service import (INSTRUCTION_PREFIX, DiscardPlan, InputError, Services, discard, first_difference,
                         plan_discard, task_turns)
from app.records import Episode
from app.store import StoreError
from app.trace_io import TraceFileError, export_episodes, export_otlp, import_records, read_foreign, read_trace_file
from app.ui import constants as C
from app.ui import render
from app.ui.run_callbacks import RunCallbacks, form_from_request, message_html

DATE = re.compile(r"^\d{4}-\d{2}-\d{2}$")


def date_filter(value: str | None, name: str) -> str | None:
    value = (value or "").strip()
    if value and not DATE.match(value):
        raise InputError(f"{name} must be a date written YYYY-MM-DD (e.g. 2026-12-02); got {value!r}.")
    return value or None


def choice(value: str | None) -> str | None:
    """A filter dropdown's value, None for "all"."""
    return None if value in (None, "", C.ALL) else value


class TracesCallbacks:
    def __init__(self, services: Services) -> None:
        self.services = services

    def filter_choices(self) -> tuple[Any, Any, Any, Any]:
        """Current values of the model, adapter and mode filters, and the episode pickers."""
        store = self.services.store
        ids = [r["id"] for r in store.find_episodes(limit=500)]
        return (gr.Dropdown(choices=[C.ALL] + store.episode_values("model")),
                gr.Dropdown(choices=[C.ALL] + store.episode_values("adapter")),
                gr.Dropdown(choices=ids), gr.Dropdown(choices=ids))

    def list_episodes(self, task: str, env_class: str, mode: str, model: str, adapter: str, success: str,
                      since: str, until: str) -> tuple[list[list[Any]], str, Any]:
        """The episodes table under the filters, and the id picker's choices."""
        try:
            filters: dict[str, Any] = {
                "task_contains": (task or "").strip() or None, "mode": choice(mode), "model": choice(model),
                "adapter": choice(adapter), "success": choice(success),
                "since": date_filter(since, "From"), "until": date_filter(until, "To")}
        except InputError as exc:
            return gr.skip(), message_html(str(exc), "error"), gr.skip()
        env = choice(env_class)
        if env:
            filters["task_ids"] = self.services.catalog.ids_with_class(env) + [f"{INSTRUCTION_PREFIX}{env}"]
        rows = self.services.store.find_episodes(**filters)
        note = f"{len(rows)} episode(s)." + (" Click a row to open it." if rows else "")
        return render.episode_rows(rows), message_html(note), gr.Dropdown(choices=[r["id"] for r in rows])

    @staticmethod
    def select_row(table: Any, evt: gr.SelectData) -> str:
        row = evt.index[0] if isinstance(evt.index, (list, tuple)) else evt.index
        values = table.values.tolist() if hasattr(table, "values") else table
        return values[row][0]

    def _load(self, episode_id: str | None) -> Episode:
        if not episode_id:
            raise InputError("Pick an episode first (click a row of the table, or choose its id).")
        try:
            return self.services.store.get_episode(episode_id)
        except StoreError as exc:
            raise InputError(str(exc)) from None

    def open_episode(self, episode_id: str | None) -> tuple[Any, ...]:
        """Open an episode read-only at its first step."""
        try:
            ep = self._load(episode_id)
        except InputError as exc:
            return (message_html(str(exc), "error"), None, gr.skip(), gr.skip(), gr.skip(), gr.skip(), gr.skip())
        last = max(len(ep.steps) - 1, 0)
        step_picker = gr.Slider(minimum=0, maximum=max(last, 1), value=0, step=1, interactive=len(ep.steps) > 1)
        return ("", ep, render.episode_status(ep), step_picker, *self.show_step(ep, 0))

    def show_step(self, ep: Episode | None, index: float | None) -> tuple[Any, str, str]:
        """Conversation up to the step, the step's branches, its state diff."""
        if ep is None:
            return [], render.branch_cards(None, "Open an episode."), render.state_view(None)
        if not ep.steps:
            return [], render.branch_cards(None, "This episode has no steps."), render.state_view(None)
        i = min(max(int(index or 0), 0), len(ep.steps) - 1)
        step = ep.steps[i]
        chat = render.chat_messages(task_turns(ep.task_id, ep), ep.steps, upto=i)
        return chat, render.branch_cards(step), render.state_view(step)

    def continue_episode(self, episode_id: str | None, session: Any, form_names: list[str]) -> tuple[Any, ...]:
        """Carry on with an unfinished episode in the Run tab: (message, Run form values in
        `form_names` order, the Run tab's view, the selected tab)."""
        skip = (gr.skip(),) * (len(form_names) + 6 + 1)
        try:
            ep = self._load(episode_id)
            request = session.resume(self.services, ep.id)
        except InputError as exc:
            return (message_html(str(exc), "error"), *skip)
        values = form_from_request(request)
        view = RunCallbacks(self.services).view(session, message_html(
            f"Continuing episode {ep.id} after its {len(ep.steps)} step(s): press Step."
            + "".join(f" {n}" for n in session.take_notices())))
        session.compute_ahead(self.services)  # its next step, while the person looks at where it stopped
        return (message_html(f"Episode {ep.id} continues in the Run tab."),
                *[values.get(name, gr.skip()) for name in form_names], *view, gr.Tabs(selected="run"))

    def ask_discard(self, episode_id: str | None) -> tuple[str, Any, Any, str]:
        """Discard pressed: what it would delete, asked in the confirmation box (nothing is deleted yet).
        (message, the plan awaiting confirmation, the box, its question)."""
        try:
            plan = plan_discard(self.services.store, episode_id)
        except InputError as exc:
            return message_html(str(exc), "error"), None, gr.Group(visible=False), ""
        return "", plan, gr.Group(visible=True), render.md_text(plan.question())

    def discard_episode(self, plan: DiscardPlan | None) -> tuple[str, None, Any]:
        """The person confirmed: delete the episode the question named (message, no plan, the box hidden)."""
        if plan is None:
            return message_html("Nothing to discard: press Discard first.", "error"), None, gr.Group(visible=False)
        try:
            text = discard(self.services.store, plan)
        except InputError as exc:
            return message_html(str(exc), "error"), None, gr.Group(visible=False)
        return message_html(text), None, gr.Group(visible=False)

    @staticmethod
    def keep_episode(plan: DiscardPlan | None) -> tuple[str, None, Any]:
        text = f"Episode {plan.episode_id} kept: nothing was deleted." if plan else ""
        return message_html(text), None, gr.Group(visible=False)

    def compare(self, a_id: str | None, b_id: str | None) -> str:
        try:
            a, b = self._load(a_id), self._load(b_id)
        except InputError as exc:
            return message_html(str(exc), "error")
        return render.comparison(a, b, first_difference(a, b))

    def import_file(self, path: str | None, skip_existing: bool) -> str:
        """Validate the whole uploaded file, then write it in one transaction (or nothing)."""
        if not path:
            return message_html("Choose a .jsonl file written by Export (or `python -m app export --format episodes`).",
                                "error")
        try:
            records = read_trace_file(path, int(C.MAX_IMPORT_MB * 2**20))
            result = import_records(self.services.store, records, skip_existing=bool(skip_existing))
        except (TraceFileError, StoreError) as exc:
            return message_html(f"Nothing was imported: {exc}", "error")
        skipped = f"; {len(result.skipped)} already here were skipped" if result.skipped else ""
        return message_html(f"Imported {len(result.imported)} episode(s) with {result.annotations} "
                            f"annotation(s){skipped}.")

    def _export_listed(self, table: Any, write: Any, file_name: str, done: str) -> tuple[Any, str]:
        """The episodes listed in the table, oldest first as the CLI writes them, through `write(store, out, ids)`."""
        values = table.values.tolist() if hasattr(table, "values") else (table or [])
        ids = [row[0] for row in values if row and row[0]]
        if not ids:
            return None, message_html("No episodes listed: search first, then export.", "error")
        out = Path(tempfile.mkdtemp(prefix="envace-export-")) / file_name
        try:
            n = write(self.services.store, out, reversed(ids))
        except StoreError as exc:
            return None, message_html(str(exc), "error")
        return str(out), message_html(done.format(n=n))

    def export_listed(self, table: Any) -> tuple[Any, str]:
        """The episodes listed in the table (with their annotations) as one JSONL file to download."""
        return self._export_listed(table, export_episodes, "episodes.jsonl", "Exported {n} episode(s).")

    # ------------------------------------------------------------ another agent's traces (issue 37, parts 1 and 6)

    def import_traces(self, path: str | None, fmt: str | None, skip_existing: bool) -> str:
        """Validate a whole chat JSONL or OTLP/JSON file, then write its episodes in one transaction (or nothing);
        says what each trace did not record."""
        if not path:
            return message_html("Choose a trace file: chat JSONL ({\"messages\", \"tools\"} per line) or "
                                "OTLP/JSON spans.", "error")
        try:
            records = read_foreign(path, fmt or "openai", int(C.MAX_IMPORT_MB * 2**20))
            result = import_records(self.services.store, records, skip_existing=bool(skip_existing))
        except (TraceFileError, StoreError) as exc:
            return message_html(f"Nothing was imported: {exc}", "error")
        skipped = f"; {len(result.skipped)} already here were skipped" if result.skipped else ""
        missing = sorted({m for r in records if r.episode.id in result.imported and r.episode.trace
                          for m in r.episode.trace.missing})
        said = f" Not recorded in the file: {'; '.join(missing[:8])}{' …' if len(missing) > 8 else ''}." if missing else ""
        return message_html(f"Imported {len(result.imported)} trace(s) as episodes{skipped}: click one in the table above to "
                            f"see every recorded call with its real response.{said}")

    def export_listed_otlp(self, table: Any) -> tuple[Any, str]:
        """The episodes listed in the table as OTLP/JSON (one trace per episode, rehearsals as span attributes)."""
        return self._export_listed(table, export_otlp, "traces.otlp.jsonl",
                                   "Exported {n} episode(s) as OTLP/JSON traces.")

# ---------------------------------------------------------------- rehearse with a model / compare world models
# (issue 37: kept apart from the callbacks above; the service does the work: app.service.rehearsal,
# app.service.model_comparison)


class RehearseCallbacks:
    """Rehearse stored episodes with a world model (teacher-forced), and compare world models on them."""

    def __init__(self, services: Services) -> None:
        self.services = services

    def choices(self) -> tuple[Any, Any]:
        """The episodes that can be rehearsed (every one that is not a rehearsal), for both pickers."""
        from app.service.rehearsal import rehearsable_ids

        ids = rehearsable_ids(self.services.store)
        return gr.Dropdown(choices=ids), gr.Dropdown(choices=ids)

    def rehearse(self, episodes: list[str] | str | None, model: str, adapter: str | None, alternatives: float | None,
                 progress: gr.Progress = gr.Progress()) -> str:
        """Rehearse the picked episodes with the model; one line saying what was written, or what to fix."""
        from app.service.rehearsal import parse_episode_ids, rehearse_episodes, summary

        try:
            ids = parse_episode_ids(episodes)
            model = (model or "").strip() or C.DEFAULT_MODEL
            chosen = None if adapter in (None, "", C.NO_ADAPTER) else adapter
            policy = self.services.policy(model, chosen)
            result = rehearse_episodes(
                self.services.store, ids, policy, model=model, adapter=chosen, alternatives=int(alternatives or 0),
                remember=self.services.remember,
                progress=lambda done, total, what: progress((done, total), desc=f"rehearsing {what}", unit="calls"))
        except (InputError, StoreError) as exc:
            return message_html(str(exc), "error")
        return message_html(summary(result))

    def compare(self, episodes: list[str] | str | None, models: str) -> tuple[Any, Any, str, Any, Any]:
        """(table, figure, message, the disagreement picker, the comparison kept for it)."""
        from app.service.model_comparison import compare_models, comparison_figure, parse_models, table_rows
        from app.service.rehearsal import parse_episode_ids

        try:
            comparison = compare_models(self.services.store, parse_episode_ids(episodes), parse_models(models))
        except InputError as exc:
            return gr.skip(), gr.skip(), message_html(str(exc), "error"), gr.skip(), gr.skip()
        keys = [d.key for d in comparison.disagreements]
        note = (f"{comparison.calls} recorded call(s) compared across {len(comparison.models)} models; they predicted "
                f"differently at {len(keys)}" + (": pick one to open it side by side." if keys else "."))
        return (table_rows(comparison), comparison_figure(comparison), message_html(note),
                gr.Dropdown(choices=keys, value=keys[0] if keys else None), comparison)

    @staticmethod
    def open_disagreement(comparison: Any, key: str | None) -> str:
        """The picked call as each model rehearsed it, one column per model."""
        found = next((d for d in comparison.disagreements if d.key == key), None) if comparison else None
        if found is None:
            return render.branch_cards(None, "Compare models, then pick a call where they disagree.")
        columns = "".join(f'<div><div class="ea-label">{render.esc(label)}</div>{render.branch_card(b)}</div>'
                          for label, b in found.branches.items())
        return (f'<div class="ea-label">{render.esc(found.key)}: <code>{render.esc(found.call)}</code></div>'
                f'<div style="display:grid;grid-template-columns:repeat({len(found.branches)},minmax(0,1fr));'
                f'gap:8px">{columns}</div>')
