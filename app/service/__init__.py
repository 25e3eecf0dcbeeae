"""The inspector's service layer: what the UI asks of the engine and the store, without Gradio.

- `annotations`: saving an annotation (a corrected action checked against the step's tools, a corrected
  response into the rehearsal memory at once) and the fine-tune's episode picker.
- `forms`: form fields -> `RunSettings` / `Annotation`, or an `InputError` saying what to fix.
- `catalog`: the task catalog, typed instructions, the Run tab's `RunRequest`, adapters on disk.
- `session`: `Services` (shared by every browser session: store, catalog, policy cache) and
  `RunSession` (one session's run, saved step by step).
- `diffing`: where two episodes first committed different actions.
- `dashboard`: the Dashboard's plotly figures from the store's read queries (and the figure style the other
  modules' figures share).
- `finetune`: the Fine-tune tab's form, data preview and job around `app.training.finetune`, and its figures.
- `episodes`: stored episodes the Traces tab acts on (what a discard would delete).
- from the engine's report: why an episode ended (`end_reason_text`), what a step's compute took (`compute_time`).

The UI reaches the engine, environments and models only through this package (tests/test_architecture.py);
nothing here imports Gradio. One module per concern, its plotly figures included (`dashboard`, `finetune`,
`model_comparison`).
"""
from app.engine.report import compute_time, end_reason_text
from app.service.annotations import SavedAnnotation, annotated_episode_choices, branch_use_note, save_annotation
from app.service.catalog import ENV_CLASSES, INSTRUCTION_PREFIX, RunRequest, task_turns
from app.service.diffing import first_difference
from app.service.episodes import DiscardPlan, discard, plan_discard, success_text
from app.service.forms import InputError, build_annotation, parse_number, parse_settings
from app.service.session import AheadStatus, RunSession, Services, load_note

__all__ = ["AheadStatus", "branch_use_note", "load_note", "success_text", "DiscardPlan", "ENV_CLASSES", "INSTRUCTION_PREFIX", "InputError", "RunRequest", "RunSession",
           "SavedAnnotation", "Services", "annotated_episode_choices", "build_annotation", "compute_time", "discard",
           "end_reason_text", "first_difference", "parse_number", "parse_settings", "plan_discard", "save_annotation",
           "task_turns"]
