"""Typed trace records: Episode -> Step -> Branch, and Annotation.

These cross every boundary (engine -> store -> CLI/UI -> JSONL), so one name means one
thing everywhere. The store writes them from their own `model_dump()`.
"""
from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, Literal, get_args

from pydantic import BaseModel, Field, field_validator, model_validator

Mode = Literal["none", "parallel", "sequential"]
Selector = Literal["judge", "logprob", "memory", "oracle"]
"""`oracle` is evaluation-only (the real best-of-K baseline, app/engine/oracle.py): not in SELECTORS."""
RehearsalContext = Literal["history", "history+state"]
ToolChoice = Literal["auto", "first", "required"]
Proposal = Literal["sample", "tools"]
ActualSource = Literal["committed", "shadow"]
MemoryMode = Literal["off", "seed", "online"]
"""Which real transitions a rehearsal may be conditioned on (`app.engine.memory`): none; the seed (replays of
the training split's ground truth and exploration from its states); everything observed (the seed, every
committed and shadow call, imports, corrections)."""
TransitionSource = Literal["expert", "explore", "committed", "shadow", "imported", "correction"]
ActionKind = Literal["call", "answer", "parse_error"]
EndReason = Literal["answered", "step_budget", "no_turn_left", "stopped", "failed", "interrupted"]
"""Why an episode ended: its last user turn ended with the agent's answer, or when the turn's step budget ran out
(every turn done either way); no user turn was left to answer (a continued episode whose typed turn was never
answered); it was stopped (Stop, Reset, a changed task or settings, a run's turn limit); a step failed; the process
running it died."""
TurnEnd = Literal["answer", "step_budget"]
"""What ended a user turn: the agent answered, or the turn's step budget ran out first."""
Label = Literal["match", "minor", "major", "hallucinated_state", "wrong_format"]
LABELS: tuple[str, ...] = get_args(Label)

MODES: tuple[str, ...] = ("none", "parallel", "sequential")
SELECTORS: tuple[str, ...] = ("judge", "logprob", "memory")
REHEARSAL_CONTEXTS: tuple[str, ...] = ("history", "history+state")
DEFAULT_REHEARSAL_CONTEXT: RehearsalContext = "history+state"
"""What a Rehearse prompt shows by default: the episode's calls and results, and the state before the call (the
tool's own class's, `formats.state_section`). The shipped adapter was trained on both forms; with the state its
forced `exact` on the 290 held-out calls is 0.590 against 0.517 with the history alone, and in its own episodes it
foresees 28 of 50 real errors against 31 (3 false alarms against 6; docs/world_model.md). `history` shows the
calls and results alone (a model never trained on the state does better with it)."""
MEMORY_MODES: tuple[str, ...] = get_args(MemoryMode)
TRANSITION_SOURCES: tuple[str, ...] = get_args(TransitionSource)
TOOL_CHOICES: tuple[str, ...] = get_args(ToolChoice)
PROPOSALS: tuple[str, ...] = get_args(Proposal)


def utcnow() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


class Call(BaseModel):
    """A parsed tool call."""

    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)


class Metrics(BaseModel):
    """Divergence of the predicted response from the actual one (None: not measurable)."""

    json_valid: bool | None = None
    """The rehearsal produced parseable JSON."""
    exact: bool | None = None
    """Canonical JSON of predicted equals actual."""
    field_f1: float | None = None
    """F1 over flattened (leaf path, value) pairs."""
    error_agree: bool | None = None
    """Both are errors, or both are successes."""
    surprise: float | None = None
    """Mean NLL per token of the actual response under the Rehearse role."""


class Transition(BaseModel):
    """One real (call, response) pair: what the rehearsal memory holds and retrieves (`app.engine.memory`)."""

    tool: str
    arguments: dict[str, Any] = Field(default_factory=dict)
    response: Any = None
    """The real response (JSON), `{"error": ...}` for a failed call."""
    error: bool = False
    read_only: bool = False
    env_class: str = ""
    """The environment class that owns the tool (e.g. `GorillaFileSystem`); empty when unknown."""
    source: TransitionSource = "committed"
    """Where it was observed: a replay of a training task's ground truth (`expert`), a call explored from a
    training state (`explore`), an episode's committed call or a shadow execution on a fork, an imported
    trace, or an annotator's corrected response."""
    task_id: str | None = None
    split: str | None = None
    """The task's split (`train`, `heldout`) where it has one."""
    episode_id: str | None = None
    step: int | None = None
    branch: int | None = None
    id: int | None = None
    """The store's row id (None before it is written)."""


class MemoryHit(BaseModel):
    """A transition a rehearsal was conditioned on, as the branch records it (provenance on the card)."""

    id: int | None = None
    """The transition's row id in the store (None for one not written, e.g. in a test)."""
    tool: str
    arguments: dict[str, Any] = Field(default_factory=dict)
    response: Any = None
    error: bool = False
    source: TransitionSource = "committed"
    task_id: str | None = None
    score: float = 0.0
    """Retrieval score (BM25 over the canonical arguments; an exact call match ranks first)."""


class Branch(BaseModel):
    """One candidate action at a step."""

    index: int
    action_text: str
    """The raw Act output."""
    kind: ActionKind
    call: Call | None = None
    parse_error: str | None = None
    sampled: bool = False
    """False for the greedy primary candidate."""
    act_logprob: float | None = None
    """Mean token log-probability of the action under the Act role."""
    predicted_text: str | None = None
    """The raw Rehearse output."""
    predicted: Any = None
    """The parsed predicted response (None when unparseable or not rehearsed)."""
    actual: Any = None
    """The real response: from the committed call, or from shadow execution on a fork."""
    actual_source: ActualSource | None = None
    actual_error: bool | None = None
    shadow_state_after: dict[str, Any] | None = None
    """The fork's public state after the shadow call (writes included), to diff against the
    step's `state_before`; None when the branch was not shadow-executed."""
    not_executed: str | None = None
    """Why a call branch has no actual response (not committed, not shadow-executed), e.g.
    "shadow execution off"; None when it has one or is not a call."""
    scores: dict[str, float] = Field(default_factory=dict)
    """Selector scores, e.g. {"judge": 0.71} or {"logprob": -0.4}."""
    metrics: Metrics = Field(default_factory=Metrics)
    chosen: bool = False
    duplicates: int = 0
    """Sampled candidates folded into this branch because their canonical call was equal."""
    memory: list[MemoryHit] = Field(default_factory=list)
    """The real transitions retrieved into this branch's Rehearse prompt (empty: memory off or none found)."""


class Step(BaseModel):
    """One agent decision."""

    index: int
    """0-based within the episode."""
    turn: int
    """0-based user turn."""
    branches: list[Branch]
    chosen: int
    """Index of the committed branch."""
    kind: ActionKind
    """Kind of the committed action."""
    state_before: dict[str, Any] = Field(default_factory=dict)
    state_after: dict[str, Any] = Field(default_factory=dict)
    rehearsals: int = 0
    shadow_calls: int = 0
    external_calls: int = 0
    duration_s: float = 0.0
    """Seconds from Step to the step's record (for a step computed ahead, only what was left to do)."""
    ahead_s: float = 0.0
    """Wall-clock seconds its work ran ahead of time (`EpisodeRunner.compute_ahead`, while a person read the step
    before; a wait for the model busy with another session's step included), before Step committed it; 0 when
    none did. What its compute took: `compute_s`."""
    created_at: str = Field(default_factory=utcnow)

    @property
    def compute_s(self) -> float:
        """Seconds the step's compute took in all: ahead of time, then at Step."""
        return self.ahead_s + self.duration_s

    @property
    def chosen_branch(self) -> Branch:
        return self.branches[self.chosen]


class TurnResult(BaseModel):
    turn: int
    success: bool
    state_ok: bool = True
    response_ok: bool = True
    steps: int = 0
    ended_by: TurnEnd | None = None
    """None in traces recorded before it was kept."""
    details: dict[str, Any] = Field(default_factory=dict)


class RunSettings(BaseModel):
    """How an episode is run: everything that, with the seed, fixes the episode."""

    mode: Mode = "parallel"
    branches: int = Field(4, ge=1, le=16)
    """K: candidates per step (parallel) or attempts (sequential); 1 in mode none."""
    selector: Selector = "judge"
    temperature: float = Field(0.8, ge=0.0, le=2.0)
    seed: int = Field(0, ge=0, le=2**31 - 1)
    shadow: bool = True
    """Shadow-execute non-chosen calls on forks (inspection only; only read-only calls where the
    environment cannot fork)."""
    rehearsal_context: RehearsalContext = DEFAULT_REHEARSAL_CONTEXT
    tool_choice: ToolChoice = "auto"
    """`required` prefills `<tool_call>` so every step calls a tool (as OpenAI's tool_choice); `first` does
    so on the first step after each user message (a request gets at least one call), later steps may
    answer; `auto` lets every step answer in plain text."""
    proposal: Proposal = "sample"
    """How the K candidates differ (`app.engine.proposals`): `sample`, the greedy action plus K-1 sampled at
    the temperature; `tools`, the greedy action plus greedy calls to the K-1 other tools the model ranks
    first. `sample` stays the default (cheaper per step); with tool relevance on, `tools` at K=2 measured best on the
    card's held-out protocol, 5 turns of 48 against none's 4 (docs/HISTORY.md)."""
    relevance: float = Field(0.0, ge=0.0, le=4.0)
    """Weight of the noisy-channel score log P(request | tool) in the step's tool ranking (`app.engine.proposals`);
    0 leaves the tool to the greedy action."""
    relevance_top: int = Field(0, ge=0, le=256)
    """The channel scores the request under the tools the direct score ranks first, this many (0: every tool);
    the others rank below them (`proposals.rank_tools`). 0 by default: 8 cut the first step's scoring 84 -> 49 s
    (p50, 3 tasks, a machine loaded 10-fold) but put the expert's tool first at 5 of 18 call steps against 7
    (bench/results/step_latency_channel.json)."""
    constrain: bool = True
    """Schema-constrained decoding (local models): an Act call names a tool of the step and
    matches its argument schema, a rehearsal matches the response schema or `{"error": str}`."""
    max_steps_per_turn: int | None = Field(None, ge=1, le=64)
    """Overrides the task's budget when set."""
    max_action_tokens: int = Field(96, ge=8, le=1024)
    max_rehearsal_tokens: int = Field(128, ge=8, le=2048)
    memory: MemoryMode = "off"
    """Which real transitions each Rehearse prompt retrieves from (`app.engine.memory`). Off by default: on 100
    held-out forced calls memory lowered `exact` with the shipped adapter (0.44 off, 0.30 seed) and with a
    retrained one (0.51 off, 0.45 seed; docs/world_model.md). Every real response is remembered whatever this
    says, so switching it on later retrieves everything seen since."""
    memory_k: int = Field(3, ge=0, le=8)
    """How many retrieved transitions a Rehearse prompt shows (at most; fewer within the token budget)."""
    keep_primary: bool = True
    """Parallel mode: the selector may move the commit off the greedy primary (branch 0) only on evidence shown to
    be reliable: the primary's rehearsal predicts an error and the chosen branch's does not
    (`selection.keep_primary`). Off: the selector's highest score commits, however small its margin."""

    @classmethod
    def from_stored(cls, values: dict[str, Any]) -> "RunSettings":
        """Settings read back from a store or a file: those written before `constrain` existed
        were decoded freely, so a missing `constrain` means False there (not the new default); those
        written before `proposal` existed sampled their alternatives (the default); those written before
        `relevance` existed ranked no tools (0), and those before `relevance_top` existed scored every tool (0);
        those written before `memory` existed retrieved nothing; those written before `keep_primary` existed
        committed the selector's choice."""
        return cls(**{"constrain": False, "relevance": 0.0, "relevance_top": 0, "memory": "off", "keep_primary": False,
                      **values})


TraceFormat = Literal["openai", "otlp"]
TRACE_FORMATS: tuple[str, ...] = get_args(TraceFormat)
TRACE_PREFIX = "trace:"
"""Task ids of imported traces: `trace:<format>/<name>` (`app.trace_io`); their tools and user turns are the
episode's own (`Episode.trace`), answered by `app.envs.recorded`."""


class TraceTool(BaseModel):
    """A tool as an imported trace declared it."""

    name: str
    description: str = ""
    parameters: dict[str, Any] | None = None
    """JSON schema of the arguments; None when the trace did not record one (stated in `TraceSource.missing`)."""


class TraceSource(BaseModel):
    """What an imported trace recorded besides its calls (`app.trace_io`): where it came from, its user turns and
    system prompt, the tools it declared, and what it did not record."""

    format: TraceFormat
    """The format it was read from: `openai` (chat JSONL) or `otlp` (OTLP/JSON spans)."""
    file: str = ""
    """The name of the file it was read from."""
    trace_id: str = ""
    """Where it was in the file: `line N` of a chat JSONL, the OpenTelemetry trace id of spans."""
    system: str = ""
    """The system prompt as recorded (empty when none was)."""
    turns: list[list[dict[str, str]]] = Field(default_factory=list)
    """User messages per turn (`{"role": "user", "content": ...}`), as `Task.turns`."""
    tools: list[TraceTool] = Field(default_factory=list)
    """The tools the trace declared, then those it only called (without a schema)."""
    missing: list[str] = Field(default_factory=list)
    """What the trace did not record, one sentence each (a tool's schema, a call's result, the agent's model):
    stated, never guessed."""


class Episode(BaseModel):
    """One task under one model and one rehearsal setting."""

    id: str
    task_id: str
    model: str
    adapter: str | None = None
    settings: RunSettings
    status: Literal["running", "finished", "stopped", "failed", "interrupted"] = "running"
    """`interrupted`: the process writing it died mid-episode (found at the next start); its
    complete steps are kept, and it can be continued or discarded."""
    success: bool | None = None
    turn_results: list[TurnResult] = Field(default_factory=list)
    external_calls: int = 0
    shadow_calls: int = 0
    rehearsals: int = 0
    steps: list[Step] = Field(default_factory=list)
    created_at: str = Field(default_factory=utcnow)
    finished_at: str | None = None
    error: str | None = None
    end_reason: EndReason | None = None
    """Why it ended (None while running, and in traces recorded before it was kept: `engine.report.end_reason_text`
    then tells from its status and steps)."""
    trace: TraceSource | None = None
    """An imported trace's own record (`app.trace_io`); None for an episode run here."""
    source_episode: str | None = None
    """A rehearsal of a recorded episode (`app.engine.trace_rehearsal`): the id of the episode whose recorded calls
    this model predicted, teacher-forced on its recorded history; None for an episode that ran."""

    @field_validator("settings", mode="before")
    @classmethod
    def _stored_settings(cls, value: Any) -> Any:
        # A dict comes from a store or a file: read it as RunSettings.from_stored does.
        return RunSettings.from_stored(value) if isinstance(value, dict) else value


CorrectedActionKind = Literal["call", "answer"]


class Annotation(BaseModel):
    """A person's judgement of one branch."""

    branch_id: int
    label: Label | None = None
    corrected_action: str | None = None
    corrected_action_kind: CorrectedActionKind | None = None
    """What the corrected action is: a tool call (checked against the step's tools when saved) or a plain-text
    answer the person marked as such. None: no corrected action, or one saved before the kind was recorded (read
    by parsing it)."""
    corrected_predicted: Any = None
    corrected_predicted_set: bool = False
    """The corrected response is set: `corrected_predicted` is the correction, `null`, `""`, `0` and `false`
    included. False: no corrected response (whatever `corrected_predicted` holds)."""
    note: str = ""
    annotator: str = ""
    created_at: str = Field(default_factory=utcnow)

    @model_validator(mode="before")
    @classmethod
    def _stored_flags(cls, values: Any) -> Any:
        # Written before the flag existed (or a store's NULL column): a non-null value was a correction, a null
        # one was none.
        if isinstance(values, dict) and values.get("corrected_predicted_set") is None:
            values = {**values, "corrected_predicted_set": values.get("corrected_predicted") is not None}
        return values

    @property
    def corrected(self) -> bool:
        """It corrects something: a corrected response (null included) or a non-empty corrected action."""
        return self.corrected_predicted_set or bool((self.corrected_action or "").strip())
