"""Labels, choices, defaults and element ids shared by the layout, the callbacks and the tests.

A label a callback compares against lives here once: a drifted copy would be a silent bug.
"""
from __future__ import annotations

from app.config import DEFAULT_MODEL, DEFAULT_RELEVANCE, DEFAULT_TASK
from app.records import (DEFAULT_REHEARSAL_CONTEXT, LABELS, MEMORY_MODES, MODES, PROPOSALS, REHEARSAL_CONTEXTS,
                         SELECTORS, TOOL_CHOICES)
from app.trace_io import MAX_IMPORT_BYTES

__all__ = ["LABELS", "MEMORY_MODES", "MODES", "PROPOSALS", "REHEARSAL_CONTEXTS", "SELECTORS", "TOOL_CHOICES", "DEFAULT_MODEL", "DEFAULT_TASK"]

TITLE = "EnvACE Inspector"

SOURCE_TASK = "Benchmark task"
SOURCE_INSTRUCTION = "My instruction"
SOURCES = (SOURCE_TASK, SOURCE_INSTRUCTION)
ALL = "(all)"
NO_ADAPTER = "(none)"
CONTINUE = "Continue in Run tab"
DISCARD = "Discard"
DISCARD_CONFIRM = "Delete it"
DISCARD_CANCEL = "Keep it"
TASK_LIST_INFO = "type to narrow this list by id and first message; Search tasks looks everywhere"
SUCCESS_CHOICES = (ALL, "yes", "no", "unknown")
DEFAULT_INSTRUCTION_ENV = "GorillaFileSystem"

# Defaults of the Run tab. Smaller than the CLI's: on a 2-core CPU Space a step with K=2
# and short generations takes about 10-20 s, which keeps the first visit interactive.
UI_DEFAULTS = {
    "mode": "parallel",
    "branches": 2,
    "selector": "judge",
    "temperature": 0.8,
    "seed": 0,
    "shadow": True,
    "rehearsal_context": DEFAULT_REHEARSAL_CONTEXT,
    "tool_choice": "required",  # only without the shipped adapter (the bare base model never writes <tool_call>); auto with it
    "proposal": "sample",
    "relevance": DEFAULT_RELEVANCE,
    "constrain": True,
    "memory": "off",
    "memory_k": 3,
    "keep_primary": True,
    "max_action_tokens": 64,
    "max_rehearsal_tokens": 96,
}

MODEL_CONCURRENCY = 2
"""Model events running at once across all sessions. The policy runs one forward pass at a
time anyway; a second slot lets a second visitor start while the first is mid-step, and
lets a duplicate press in one session be refused at once instead of waiting behind itself."""

# The Fine-tune tab. Parent choices besides registered adapter paths:
PARENT_SHIPPED = "default (the shipped agent)"
PARENT_NONE = "(none: base weights)"
FT_DEFAULTS = {"steps": 20, "lr": 3e-4, "rank": 16, "heldout_rows": 4, "agreement": True, "unseen_rows": 16,
               "replay_ratio": 1.0, "eval_every": 5}
# Replay 1:1 and a checkpoint every 5 steps: see docs/TRAINING.md (fix the tool, keep the rest).
# 16 unseen calls per group: 64 greedy rehearsals before and after, a minute or two on 2 cores.
# 20 steps: a couple of corrections are learned in about that many on 2 cores (1-3 s a step).
FT_MAX_STEPS = 500
"""More is refused in the UI (the library allows 10,000): at 1-3 s a step on 2 cores, 500 steps
already hold the only fine-tune slot for up to half an hour; use the CLI for longer runs."""
FT_POLL_S = 0.5
"""How often the Fine-tune tab looks for new losses from the worker thread."""

# Buttons (their visible names are what the browser test clicks).
STEP, RUN_TURN, RUN_ALL, STOP, RESET = "Step", "Run turn", "Run to end", "Stop", "Reset"
SAY_AS_USER = "Send as the user"
"""Types the next user message (instead of a scripted turn, or after the last one)."""
IMPORT, EXPORT_LISTED = "Import", "Export the listed episodes"
MAX_IMPORT_MB = MAX_IMPORT_BYTES // 2**20
"""Largest episodes file the Traces tab imports (also Gradio's upload limit in `serve` and app.py)."""
SAVE_NEXT, PREV, NEXT = "Save & next", "◀ Prev", "Next ▶"
FT_PREVIEW, FT_RUN = "Preview data", "Fine-tune"

# Element ids used by the keyboard script and the browser test.
ID_RUN_MESSAGE = "run-message"
ID_RUN_STATUS = "run-status"
ID_RUN_AHEAD = "run-ahead"
AHEAD_POLL_S = 1.0
"""How often the Run tab asks whether the next step is computed ahead (a `gr.Timer`)."""
ID_CARDS = "run-cards"
ID_RUN_STOP = "run-stop"
CLASS_FULL_ON_HOVER = "ea-full-on-hover"
"""Dropdowns whose whole value shows as a tooltip on hover."""
ID_ANN_PANEL = "annotate-panel"
ID_ANN_LABEL = "ann-label"
ID_ANN_SAVE = "ann-save"
ID_ANN_PREV = "ann-prev"
ID_ANN_NEXT = "ann-next"
ID_ANN_CHEATSHEET = "ann-cheatsheet"
ID_ANN_MESSAGE = "ann-message"
ID_ANN_CODE = "ann-corrected-predicted"
ID_ANN_ANSWER = "ann-plain-answer"
ANN_PLAIN_ANSWER = "Plain answer (not a tool call)"
ID_TRACES_STATUS = "traces-status"
ID_TRACES_TABLE = "traces-table"
ID_TRACES_CARDS = "traces-cards"
ID_TRACES_UPLOAD = "traces-upload"
ID_TRACES_IO_MESSAGE = "traces-io-message"
# Another agent's traces (issue 37): chat JSONL or OTLP/JSON in, OTLP/JSON out.
IMPORT_TRACES, EXPORT_OTLP = "Import traces", "Export the listed episodes as OTLP/JSON"
TRACE_FORMAT_CHOICES = (("OpenAI chat JSONL (messages + tools)", "openai"),
                        ("OpenTelemetry OTLP/JSON (GenAI or OpenInference spans)", "otlp"))
ID_TRACES_FOREIGN_UPLOAD = "traces-foreign-upload"
ID_TRACES_FOREIGN_MESSAGE = "traces-foreign-message"
ID_TRACES_MESSAGE = "traces-message"
ID_REHEARSE_EPISODES = "rehearse-episodes"
ID_REHEARSE_MESSAGE = "rehearse-message"
ID_MODELS_SIDE_BY_SIDE = "models-side-by-side"
REHEARSE = "Rehearse with a model"
COMPARE_MODELS = "Compare models"
ID_DISCARD_CONFIRM = "traces-discard-confirm"
ID_TASK_SEARCH = "run-task-search"
ID_FT_MESSAGE = "ft-message"
ID_ANN_ANNOTATOR = "ann-annotator"
ANNOTATOR_STORAGE_KEY = "envace-annotator"
"""The browser's localStorage key under which the Annotate tab keeps the annotator's name (`gr.BrowserState`)."""
