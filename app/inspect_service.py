"""The inspector's service layer: what the UI asks of the engine and the store, without Gradio.

`Services` is shared by every browser session (the store, the task catalog, the policy
cache). `RunSession` is one session's run: its own `EpisodeRunner`, saving each finished
step through a `Recorder`. Nothing of a session's run reaches another session except
through the database, and only once a step is saved.
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from pydantic import ValidationError

from app import envs
from app.config import DEFAULT_MODEL
from app.envs.base import Task, TurnCheck
from app.envs.bfcl_tasks import CLASS_SOURCES
from app.engine import selection
from app.engine.history import with_typed_turns
from app.formats import branch_key, parse_action
from app.records import LABELS, MODES, Annotation, Episode, RunSettings, Step
from app.store import Recorder, Store, StoreError
from model_backend.base import RemoteCapabilityError

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parent.parent
INSTRUCTION_PREFIX = "instruction:"
"""Task ids of typed instructions: `instruction:<EnvClass>` (no ground truth, never judged)."""
INSTRUCTION_BUDGET = 4
"""Steps per turn for a typed instruction (there is no gold sequence to size it from)."""
ENV_CLASSES: tuple[str, ...] = tuple(CLASS_SOURCES)

PolicyLoader = Callable[[str, "str | None"], Any]
Report = Callable[[float, str], None]


class InputError(ValueError):
    """Input the user can fix; the message says how (shown in the UI, nothing written)."""


class SessionBusyError(InputError):
    """A second run was asked for while this session's run is still working."""


# ---------------------------------------------------------------- settings


_SETTING_NAMES = {"branches": "K (branches)", "seed": "Seed", "temperature": "Temperature",
                  "max_action_tokens": "Max action tokens", "max_rehearsal_tokens": "Max rehearsal tokens",
                  "max_steps_per_turn": "Steps per turn"}


def _bound(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def parse_number(label: str, value: Any, low: float, high: float, whole: bool = True) -> float:
    """A form field as a number within [low, high] (a whole one if `whole`), or a clear InputError."""
    kind = "a whole number" if whole else "a number"
    span = f"from {_bound(low)} to {_bound(high)}"
    if value is None or value == "":
        raise InputError(f"{label} is empty: enter {kind} {span}.")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise InputError(f"{label} must be {kind} {span}; got {value!r}.") from None
    if not math.isfinite(number) or (whole and number != int(number)) or not low <= number <= high:
        raise InputError(f"{label} must be {kind} {span}; got {number:g}.")
    return number


def _whole(name: str, value: Any, low: int, high: int) -> int:
    return int(parse_number(_SETTING_NAMES.get(name, name), value, low, high))


def parse_settings(*, mode: str, branches: Any, selector: str, temperature: Any, seed: Any, shadow: bool,
                   rehearsal_context: str, tool_choice: str = "auto", constrain: bool = True,
                   max_action_tokens: Any = 96,
                   max_rehearsal_tokens: Any = 128) -> RunSettings:
    """RunSettings from raw UI values, or an InputError that names the field and its range."""
    if mode not in MODES:
        raise InputError(f"Mode must be one of {', '.join(MODES)}; got {mode!r}.")
    k = _whole("branches", branches, 1, 16)
    values = dict(mode=mode, branches=1 if mode == "none" else k, selector=selector,
                  seed=_whole("seed", seed, 0, 2**31 - 1), shadow=bool(shadow),
                  rehearsal_context=rehearsal_context, tool_choice=tool_choice, constrain=bool(constrain),
                  max_action_tokens=_whole("max_action_tokens", max_action_tokens, 8, 1024),
                  max_rehearsal_tokens=_whole("max_rehearsal_tokens", max_rehearsal_tokens, 8, 2048))
    try:
        values["temperature"] = float(temperature)
        return RunSettings(**values)
    except (TypeError, ValueError, ValidationError) as exc:
        if isinstance(exc, ValidationError):
            err = exc.errors()[0]
            name = str(err["loc"][0]) if err["loc"] else "settings"
            raise InputError(f"{_SETTING_NAMES.get(name, name.replace('_', ' ').capitalize())}: {err['msg']}.") from None
        raise InputError(f"Temperature must be a number from 0 to 2; got {temperature!r}.") from None


# ---------------------------------------------------------------- tasks


@dataclass(frozen=True)
class TaskInfo:
    id: str
    category: str
    env_classes: tuple[str, ...]
    first_message: str


class TaskCatalog:
    """Every runnable task with its category, environment classes and first user message (loaded once)."""

    def __init__(self) -> None:
        self._tasks: dict[str, TaskInfo] | None = None
        self._lock = threading.Lock()

    @property
    def tasks(self) -> dict[str, TaskInfo]:
        with self._lock:
            if self._tasks is None:
                self._tasks = {}
                for task_id in envs.list_tasks() + envs.list_tasks(suite="mock") + envs.list_tasks(suite="tau2"):
                    task = envs.load_task(task_id)
                    first = next((m["content"] for turn in task.turns for m in turn), "")
                    self._tasks[task_id] = TaskInfo(task_id, task.category, tuple(task.env_classes), first)
            return self._tasks

    @property
    def categories(self) -> list[str]:
        return sorted({t.category for t in self.tasks.values()})

    @property
    def env_classes(self) -> list[str]:
        return sorted({c for t in self.tasks.values() for c in t.env_classes})

    def filter(self, env_class: str | None = None, category: str | None = None) -> list[TaskInfo]:
        return [t for t in self.tasks.values()
                if (not env_class or env_class in t.env_classes) and (not category or t.category == category)]

    def env_classes_of(self, task_id: str) -> tuple[str, ...]:
        if task_id.startswith(INSTRUCTION_PREFIX):
            return tuple(task_id[len(INSTRUCTION_PREFIX):].split("+"))
        info = self.tasks.get(task_id)
        return info.env_classes if info else ()

    def ids_with_class(self, env_class: str) -> list[str]:
        return [t.id for t in self.tasks.values() if env_class in t.env_classes]


class UnjudgedJudge:
    """The judge of a typed instruction: there is no ground truth, so turns are recorded, not judged."""

    judges_whole_episode = True
    """Any number of user turns may follow (the person speaks as the user); none is judged."""

    def __init__(self, instruction: str) -> None:
        self.instruction = instruction

    def check_turn(self, turn_index: int, env: Any, executed: list) -> TurnCheck:
        return TurnCheck(success=False, details={"judged": False, "instruction": self.instruction,
                                                 "model_calls": len(executed)})


def instruction_task(text: str, env_class: str) -> Task:
    """A one-turn task from a typed instruction on one BFCL environment class (default initial state)."""
    text = (text or "").strip()
    if not text:
        raise InputError("The instruction is empty: type what the agent should do, or pick a benchmark task.")
    if env_class not in ENV_CLASSES:
        raise InputError(f"Pick an environment for the instruction (one of {', '.join(ENV_CLASSES)}).")
    return Task(id=f"{INSTRUCTION_PREFIX}{env_class}", category="instruction",
                turns=[[{"role": "user", "content": text}]], env_classes=[env_class],
                max_steps_per_turn=INSTRUCTION_BUDGET)


def task_turns(task_id: str, episode: Episode | None = None) -> list[list[dict[str, str]]]:
    """User turns of a stored episode's task; the ones a person typed, and typed instructions, come
    from the turn results that recorded them."""
    if task_id.startswith(INSTRUCTION_PREFIX):
        for t in episode.turn_results if episode else []:
            if t.details.get("instruction"):
                return [[{"role": "user", "content": t.details["instruction"]}]]
        return []
    try:
        turns = envs.load_task(task_id).turns
    except ValueError:
        return []
    return with_typed_turns(turns, episode.turn_results if episode else [])[0]


@dataclass(frozen=True)
class RunRequest:
    """What the Run tab asks to run: a task (or typed instruction), a model, and settings."""

    task_id: str | None
    instruction: str = ""
    env_class: str = ""
    model: str = DEFAULT_MODEL
    adapter: str | None = None
    settings: RunSettings = field(default_factory=RunSettings)

    @property
    def key(self) -> str:
        """Equal keys continue the same episode; a different key starts a new one."""
        return json.dumps([self.task_id, self.instruction.strip(), self.env_class, self.model, self.adapter,
                           self.settings.model_dump()], sort_keys=True)

    def task(self) -> tuple[Task, Any]:
        """The task and its judge (None: the suite's own)."""
        if self.task_id:
            try:
                return envs.load_task(self.task_id), None
            except ValueError as exc:
                raise InputError(str(exc)) from None
        if self.instruction.strip() or self.env_class:
            task = instruction_task(self.instruction, self.env_class)
            return task, UnjudgedJudge(self.instruction.strip())
        raise InputError("No task: pick a benchmark task, or type an instruction and pick its environment.")


# ---------------------------------------------------------------- policy


class ProgressPolicy:
    """Forwards to a policy and reports which role is working, for the UI's progress bar."""

    PHASES = {"act": 0.1, "rehearse": 0.4, "score": 0.7}

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.name = inner.name
        self.report: Report | None = None
        self.scored = 0

    @property
    def context_window(self) -> int:
        return self.inner.context_window

    def count_tokens(self, text: str) -> int:
        return self.inner.count_tokens(text)

    def reset_cache(self) -> None:
        if hasattr(self.inner, "reset_cache"):
            self.inner.reset_cache()

    def _say(self, phase: str, text: str) -> None:
        if self.report is not None:
            self.report(self.PHASES[phase] + (0.15 if phase == "score" and self.scored else 0.0), text)

    def act(self, prompt, k, config):
        self.scored = 0
        self._say("act", f"Act: proposing {k} candidate action(s)")
        return self.inner.act(prompt, k, config)

    def rehearse(self, prompts, config):
        self._say("rehearse", f"Rehearse: predicting {len(prompts)} tool response(s)")
        return self.inner.rehearse(prompts, config)

    def score(self, prompts, continuations):
        self._say("score", "Scoring: selector and surprise")
        self.scored += 1
        return self.inner.score(prompts, continuations)


def discover_adapters(root: Path = ROOT / "fixtures") -> list[str]:
    """LoRA adapter directories under fixtures/ (any folder holding an adapter_config.json)."""
    if not root.is_dir():
        return []
    return sorted(str(p.parent.relative_to(ROOT)) for p in root.glob("**/adapter_config.json"))


class Services:
    """Shared by all sessions: one store, one task catalog, one policy per (model, adapter)."""

    def __init__(self, db_path: str, policy_loader: PolicyLoader | None = None) -> None:
        self.db_path = db_path
        self.store = Store(db_path)
        interrupted = self.store.mark_interrupted()
        if interrupted:  # a server killed mid-step left them "running"; their complete steps are kept
            log.warning("%d episode(s) were interrupted by a stopped process: %s (continue or discard them in "
                        "the Traces tab)", len(interrupted), ", ".join(interrupted))
        self.catalog = TaskCatalog()
        self._loader = policy_loader or _load_real_policy
        self._policies: dict[tuple[str, str | None], Any] = {}
        self._policy_lock = threading.Lock()

    def policy(self, model: str, adapter: str | None) -> Any:
        """Loaded on first use, then cached for every session (loading is the slow part)."""
        key = (model.strip(), adapter)
        with self._policy_lock:
            if key not in self._policies:
                self._policies[key] = self._loader(*key)
            return self._policies[key]

    def adapters(self) -> list[str]:
        return sorted(set(discover_adapters()) | set(self.store.adapter_paths()))


def _load_real_policy(model: str, adapter: str | None) -> Any:
    import model_backend

    try:
        return model_backend.load_policy(model, adapter=adapter)
    except (ValueError, ImportError, FileNotFoundError, RuntimeError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else repr(exc)
        raise InputError(f"Could not load model {model!r}{f' with adapter {adapter}' if adapter else ''}: {first}") from None


# ---------------------------------------------------------------- one session's run


class RunSession:
    """One browser session's run (held in `gr.State`): its runner, its recorder, the step in view."""

    def __init__(self) -> None:
        self.runner: Any = None
        self.recorder: Recorder | None = None
        self.request: RunRequest | None = None
        self.view_step: int | None = None
        self.unjudged = False
        self.stop_requested = threading.Event()
        self._busy = threading.Lock()
        self.notices: list[str] = []
        """Messages for the user from the last action (new episode, save retried...)."""
        self.resumed = False
        """A stored episode was just continued: the next Step carries on with it."""

    def __deepcopy__(self, memo: dict) -> RunSession:
        # gr.State deep-copies its default per session: a fresh run, never a shared one.
        return RunSession()

    @property
    def episode(self) -> Episode | None:
        return self.runner.episode if self.runner is not None else None

    @property
    def task(self) -> Task | None:
        return self.runner.task if self.runner is not None else None

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        if not self._busy.acquire(blocking=False):
            raise SessionBusyError("A step is already running in this session: wait for it to finish "
                                   "(or press Stop to end a run after the current step).")
        try:
            yield
        finally:
            self._busy.release()

    @property
    def is_busy(self) -> bool:
        return self._busy.locked()

    def _record(self, ep: Episode, step: Step) -> None:
        if self.unjudged and ep.status == "finished":
            ep.success = None  # a typed instruction has no ground truth to judge against
        assert self.recorder is not None
        self.recorder(ep, step)
        if self.recorder.last_error:
            self.notices.append(f"Not saved yet: {self.recorder.last_error}")

    def ensure_runner(self, services: Services, request: RunRequest, report: Report | None = None) -> None:
        """Continue the episode when the request is unchanged; otherwise start a new one."""
        if self.runner is not None and self.request is not None and self.request.key == request.key:
            return  # the same episode, finished or not (Reset starts a fresh one)
        if (self.resumed and self.runner is not None and not self.runner.done and self.request is not None
                and (request.task_id, request.model, request.adapter)
                == (self.request.task_id, self.request.model, self.request.adapter)):
            # The form shows the continued episode (settings a form cannot express, such as a CLI
            # run's step budget, are the episode's); another task or model starts a new one.
            self.resumed, self.request = False, request
            return
        task, judge = request.task()  # validates before anything loads or is written
        if report is not None:
            report(0.02, f"Loading model {request.model} (first step only)")
        inner = services.policy(request.model, request.adapter)
        try:
            selection.check_selector(inner, request.settings.selector, request.settings.mode)
        except RemoteCapabilityError as exc:  # the CLI's wording names flags; the UI's names the control
            raise InputError("Selector judge needs prompt log-probabilities, which this model server does not "
                             "return: pick the logprob or memory selector.") from exc
        policy = ProgressPolicy(inner)
        if self.runner is not None and self.episode.steps and not self.runner.done:
            self.close(services)
            self.notices.append("Settings or task changed: started a new episode (the previous one is saved as stopped).")
        self.recorder = Recorder(services.store)
        self.unjudged = judge is not None
        env = envs.BFCLEnvironment.from_task(task) if judge is not None else None
        from app.engine import EpisodeRunner

        self.runner = EpisodeRunner(task, policy, request.settings, model=request.model, adapter=request.adapter,
                                    on_step=self._record, env=env, judge=judge)
        self.request = request
        self.view_step = None

    def resume(self, services: Services, episode_id: str) -> RunRequest:
        """Continue a stored episode that did not finish (interrupted, stopped or failed) in this
        session: its calls run again on a fresh environment, then Step carries on from there."""
        try:
            ep = services.store.get_episode(episode_id)
        except StoreError as exc:
            raise InputError(str(exc)) from None
        if ep.status == "finished":
            raise InputError(f"Episode {ep.id} is finished: there is nothing to continue.")
        if ep.status == "running":
            raise InputError(f"Episode {ep.id} is running in another session (or a process that is still alive).")
        if ep.task_id.startswith(INSTRUCTION_PREFIX):
            raise InputError("An episode of a typed instruction cannot be continued: run the instruction again.")
        request = RunRequest(task_id=ep.task_id, model=ep.model, adapter=ep.adapter, settings=ep.settings)
        task, _ = request.task()
        policy = ProgressPolicy(services.policy(request.model, request.adapter))
        self.close(services)
        from app.engine import EpisodeRunner

        self.runner = EpisodeRunner.resume(ep, task, policy, on_step=self._record)
        self.recorder, self.request, self.unjudged = Recorder(services.store), request, False
        self.view_step, self.resumed = None, True
        self._save(services)  # running again, written by this process
        if self.runner.resume_mismatches:
            self.notices.append(f"Continued, but the tools answered steps {self.runner.resume_mismatches} "
                                "differently this time: the environment may differ from the recorded one.")
        return request

    def step(self, services: Services, request: RunRequest, report: Report | None = None) -> Step | None:
        """One step (opening a new episode when needed); None when the episode is over."""
        self.ensure_runner(services, request, report)
        if self.runner.done:
            return None
        self.runner.policy.report = report
        try:
            step = self.runner.step()
        except Exception as exc:  # a model or engine failure: keep what was saved, mark the episode
            log.exception("step failed in episode %s", self.episode.id)
            self._fail(services, exc)
            raise InputError(f"The step failed and the episode was marked failed: {exc}") from exc
        finally:
            self.runner.policy.report = None
        self.view_step = None
        return step

    def iterate(self, services: Services, request: RunRequest, scope: str,
                report: Report | None = None) -> Iterator[Step]:
        """Steps until the turn (scope "turn") or the episode ("all") ends, or Stop is pressed."""
        self.stop_requested.clear()
        self.ensure_runner(services, request, report)
        turn = self.runner.turn
        while not self.runner.done and not self.stop_requested.is_set():
            if scope == "turn" and self.runner.turn != turn:
                break
            step = self.step(services, request, report)
            if step is None:
                break
            yield step
        if self.stop_requested.is_set():
            self.notices.append("Stopped after the current step; Step or Run continue this episode.")
        self.stop_requested.clear()

    def add_user_message(self, services: Services, request: RunRequest, text: str) -> int:
        """The person speaks as the user: `text` becomes the next user turn of this session's episode
        (starting one for `request` when there is none); returns the turn's index. Step then runs it."""
        self.ensure_runner(services, request)
        try:
            return self.runner.add_user_turn(text)
        except ValueError as exc:
            raise InputError(str(exc)) from None

    def request_stop(self, services: Services) -> str:
        """Ends a running loop after its current step; with nothing running, ends the episode."""
        if self.is_busy:
            self.stop_requested.set()
            return "Stopping after the current step."
        if self.runner is None or self.runner.done:
            return "Nothing to stop."
        self.close(services)
        return f"Episode {self.episode.id} stopped and saved."

    def close(self, services: Services) -> None:
        """Mark the open episode stopped; save it when it has steps (an empty one was never written)."""
        if self.runner is None or self.runner.done:
            return
        self.runner.stop()
        if self.episode.steps:
            self._save(services)

    def reset(self, services: Services) -> None:
        self.close(services)
        self.resumed = False
        reset_cache = getattr(getattr(self.runner, "policy", None), "reset_cache", None)
        if reset_cache is not None:
            reset_cache()  # the model's cached prompt prefixes go with the episode
        self.runner, self.recorder, self.request, self.view_step = None, None, None, None
        self.stop_requested.clear()

    def _fail(self, services: Services, exc: BaseException) -> None:
        ep = self.episode
        ep.status, ep.error = "failed", str(exc)[:500]
        if ep.steps:
            self._save(services)

    def _save(self, services: Services) -> None:
        try:
            (self.recorder or Recorder(services.store)).flush(self.episode)
        except StoreError as exc:
            self.notices.append(f"Not saved: {exc}")

    def take_notices(self) -> list[str]:
        out, self.notices = self.notices, []
        return out


# ---------------------------------------------------------------- traces and annotation


def committed_key(step: Step) -> str:
    """What a step did, for comparing two episodes: the committed call, answer or parse error."""
    b = step.chosen_branch
    return branch_key(b.kind, b.call, b.action_text)


def first_difference(a: Episode, b: Episode) -> int | None:
    """Index of the first step where the two episodes committed different actions (None: none)."""
    for i, (sa, sb) in enumerate(zip(a.steps, b.steps)):
        if committed_key(sa) != committed_key(sb):
            return i
    if len(a.steps) != len(b.steps):
        return min(len(a.steps), len(b.steps))
    return None


def build_annotation(branch_id: int, label: str | None, corrected_predicted: str, corrected_action: str,
                     note: str, annotator: str) -> Annotation:
    """A validated Annotation, or an InputError saying what to fix (nothing is written)."""
    label = label or None
    if label is not None and label not in LABELS:
        raise InputError(f"Unknown label {label!r}; pick one of {', '.join(LABELS)}.")
    predicted: Any = None
    text = (corrected_predicted or "").strip()
    if text:
        try:
            predicted = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InputError(f"The corrected predicted response is not valid JSON (line {exc.lineno}, "
                             f"column {exc.colno}: {exc.msg}). Fix it or clear the field.") from None
    action = (corrected_action or "").strip() or None
    if action is not None and parse_action(action).kind == "parse_error":
        raise InputError(f"The corrected action does not parse: {parse_action(action).error}. "
                         'Write <tool_call>{"name": ..., "arguments": {...}}</tool_call> or a plain-text answer.')
    if label is None and predicted is None and action is None and not (note or "").strip():
        raise InputError("Nothing to save: pick a label, or give a correction or a note.")
    annotator = (annotator or "").strip()
    if not annotator:
        raise InputError("Annotator is empty: type your name (or sign in on the Space).")
    return Annotation(branch_id=branch_id, label=label, corrected_predicted=predicted,
                      corrected_action=action, note=(note or "").strip(), annotator=annotator[:100])
