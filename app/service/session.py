"""One browser session's run, and what all sessions share.

`Services` is shared by every browser session (the store, the task catalog, the policy
cache). `RunSession` is one session's run: its own `EpisodeRunner`, saving each finished
step through a `Recorder`. Nothing of a session's run reaches another session except
through the database, and only once a step is saved.
"""
from __future__ import annotations

import atexit
import contextlib
import logging
import os
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Literal

from app.config import shipped_adapter
from app.engine import selection
from app.envs.base import Task
from app.records import TRACE_PREFIX, Episode, Step
from app.service.catalog import INSTRUCTION_PREFIX, RunRequest, TaskCatalog, discover_adapters, task_env
from app.service.forms import InputError, SessionBusyError
from app.store import Recorder, Store, StoreError
from model_backend.base import Policy, RemoteCapabilityError

log = logging.getLogger(__name__)

NO_RELEVANCE = "This model server returns no prompt log-probabilities, so it cannot rank tools"
"""The start of the notice when a form's tool relevance cannot apply (the runner turns it off)."""
PolicyLoader = Callable[[str, "str | None"], Any]
Report = Callable[[float, str], None]


class ProgressPolicy(Policy):
    """Forwards to a policy and reports which role is working, for the UI's progress bar.

    Every member of `Policy` is forwarded, its capabilities (`model_backend.base.CAPABILITIES`) too: a
    capability left to the protocol's default would answer for the wrapper, not the model (a server without
    prompt log-probabilities would seem to score)."""

    PHASES = {"act": 0.1, "rehearse": 0.4, "score": 0.7}

    def __init__(self, wrapped: Policy) -> None:
        self.wrapped = wrapped
        self.name = wrapped.name
        self.report: Report | None = None
        self.scored = 0

    @property
    def context_window(self) -> int:
        return self.wrapped.context_window

    def count_tokens(self, text: str) -> int:
        return self.wrapped.count_tokens(text)

    @property
    def inner(self) -> Policy:
        return self.wrapped.inner

    @property
    def supports_scoring(self) -> bool:
        return self.wrapped.supports_scoring

    @property
    def can_compute_ahead(self) -> bool:
        return self.wrapped.can_compute_ahead

    def computing_ahead(self, stop=lambda: False):
        return self.wrapped.computing_ahead(stop)

    def reset_cache(self) -> None:
        self.wrapped.reset_cache()

    @property
    def constraint_note(self) -> str:
        return self.wrapped.constraint_note

    def _say(self, phase: str, text: str) -> None:
        if self.report is not None:
            self.report(self.PHASES[phase] + (0.15 if phase == "score" and self.scored else 0.0), text)

    def act(self, prompt, k, config):
        self.scored = 0
        self._say("act", f"Act: proposing {k} candidate action(s)")
        return self.wrapped.act(prompt, k, config)

    def act_each(self, prompts, config):
        self._say("act", f"Act: {len(prompts)} alternative action(s), one per tool")
        return self.wrapped.act_each(prompts, config)

    def rehearse(self, prompts, config):
        self._say("rehearse", f"Rehearse: predicting {len(prompts)} tool response(s)")
        return self.wrapped.rehearse(prompts, config)

    def score(self, prompts, continuations):
        self._say("score", "Scoring: selector and surprise")
        self.scored += 1
        return self.wrapped.score(prompts, continuations)


class Services:
    """Shared by all sessions: one store, one task catalog, one policy per (model, adapter)."""

    def __init__(self, db_path: str, policy_loader: PolicyLoader | None = None,
                 compute_ahead: bool | None = None) -> None:
        """`compute_ahead`: compute each session's next step while the person reads the last one
        (`RunSession.compute_ahead`); default on, `ENVACE_COMPUTE_AHEAD=0` turns it off."""
        self.db_path = db_path
        self.compute_ahead = (os.environ.get("ENVACE_COMPUTE_AHEAD", "1") != "0" if compute_ahead is None
                              else compute_ahead)
        self.store = Store(db_path)
        interrupted = self.store.mark_interrupted()
        if interrupted:  # a server killed mid-step left them "running"; their complete steps are kept
            log.warning("%d episode(s) were interrupted by a stopped process: %s (continue or discard them in "
                        "the Traces tab)", len(interrupted), ", ".join(interrupted))
        self.catalog = TaskCatalog()
        self._loader = policy_loader or _load_real_policy
        self._policies: dict[tuple[str, str | None], Any] = {}
        self._policy_lock = threading.Lock()
        self._memory: Any = None
        self._memory_lock = threading.Lock()

    def memory(self) -> Any:
        """The rehearsal memory every session shares (`app.engine.memory.RehearsalMemory` over the store's
        transitions), built and seeded on first use: every real response a session observes, and every
        correction, joins it for all of them."""
        with self._memory_lock:
            if self._memory is None:
                from app.training.memory_seed import open_memory

                self._memory = open_memory(self.store)
            return self._memory

    def remember(self, transitions: list[Any]) -> list[Any]:
        """Add real transitions (a correction's) to the shared memory when it is open, else to the store it opens
        from; returns those that were new."""
        with self._memory_lock:
            memory = self._memory
        return memory.add(transitions) if memory is not None else self.store.add_transitions(transitions)

    def policy(self, model: str, adapter: str | None) -> Any:
        """Loaded on first use, then cached for every session (loading is the slow part)."""
        key = (model.strip(), adapter)
        with self._policy_lock:
            if key not in self._policies:
                self._policies[key] = self._loader(*key)
            return self._policies[key]

    def is_loaded(self, model: str, adapter: str | None) -> bool:
        """Whether `policy` has this model (and adapter) already: the first Step with it waits for the load. Without
        the lock, which a load holds for its whole length (a dict lookup is atomic)."""
        return (model.strip(), adapter) in self._policies

    def adapters(self) -> list[str]:
        return sorted(set(discover_adapters()) | set(self.store.adapter_paths()))

    def default_adapter(self) -> str | None:
        """The adapter a run starts with: the fine-tuned one made the default, else the shipped one (None: none)."""
        return self.store.default_adapter() or shipped_adapter()


LOAD_SLOW_S = 120
"""About the longest a load of the embedded model with the shipped adapter takes here (`Services.policy`): measured
103 s and 141 s on the project's 2-core AMD EPYC while other processes kept 10-20 of them busy (load average);
a machine to itself takes a fraction of that."""


def load_note(model: str, loaded: bool) -> str:
    """The Run tab's one sentence while a Step waits: the model loads once (first Step only) and about how long."""
    if loaded:
        return "Working: the model runs on this machine's CPU (a few seconds a step)."
    return (f"Loading model {model}: once, on the first Step only (up to about {LOAD_SLOW_S // 60} minutes on a busy "
            "2-core CPU); later steps take seconds.")


def _load_real_policy(model: str, adapter: str | None) -> Any:
    import model_backend

    try:
        return model_backend.load_policy(model, adapter=adapter)
    except (ValueError, ImportError, FileNotFoundError, RuntimeError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else repr(exc)
        raise InputError(f"Could not load model {model!r}{f' with adapter {adapter}' if adapter else ''}: {first}") from None


# ---------------------------------------------------------------- one session's run


@dataclass(frozen=True)
class AheadStatus:
    """What a session's computing ahead is doing, for the Run tab's line under the buttons."""
    state: Literal["none", "computing", "ready"]
    """none: nothing computed ahead (off, stopped, refused, failed, or taken by the step just run)."""
    step: int | None = None
    """The index of the step computed ahead."""
    seconds: float | None = None
    """How long it has run (computing) or took (ready)."""


AHEAD_THREAD = "envace-compute-ahead"
"""The name of a thread that computes a step ahead."""
_AHEAD: "weakref.WeakKeyDictionary[threading.Thread, threading.Event]" = weakref.WeakKeyDictionary()
"""Every session's work ahead still running, with its cancel event."""


@atexit.register
def _stop_all_ahead() -> None:
    """At exit, stop the work ahead and wait for the model call each is in: a thread still inside torch while
    the interpreter shuts down aborts the process."""
    for thread, cancel in list(_AHEAD.items()):
        cancel.set()
        thread.join()


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
        self._ahead: threading.Thread | None = None
        self._ahead_cancel = threading.Event()
        self._ahead_step = 0
        self._ahead_started = 0.0
        self._ahead_took: float | None = None
        """Set when the work ahead computed its whole step."""

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

    def compute_ahead(self, services: Services) -> None:
        """Start computing the next step in the background (`EpisodeRunner.compute_ahead`), so that Step then
        only commits it; anything that changes the episode or runs a step first stops it (`_stop_ahead`).
        Called once the last step is on screen; nothing where the services have it off or the episode is over."""
        self._stop_ahead()
        runner = self.runner
        if not services.compute_ahead or runner is None or runner.done:
            return
        self._ahead_cancel = cancel = threading.Event()

        def work() -> None:
            try:
                self._computed(runner.compute_ahead(cancel))
            except Exception:  # the step itself will meet (and report) whatever failed here
                log.warning("computing the next step ahead failed in episode %s", runner.episode.id, exc_info=True)

        self._start(work, cancel, len(runner.episode.steps))

    def prepare(self, services: Services, request: RunRequest) -> None:
        """A task (or typed instruction) picked with no episode in progress: open its episode and compute its
        first step, both in the background (the model loads there on first use), while the person reads the
        task; Step then finds the episode open and its first step computed. Nothing where an episode with
        steps is still running (a changed form starts a new episode only when Step is pressed), or where the
        services have computing ahead off. A request that cannot run is left for Step to report."""
        if not services.compute_ahead or (self.runner is not None and self.episode.steps and not self.runner.done):
            return
        previous, cancel = self._ahead, threading.Event()
        self._ahead_cancel.set()  # the work ahead for an earlier pick stops at its next model call
        self._ahead_cancel = cancel

        def work() -> None:
            if previous is not None:
                previous.join()
            if cancel.is_set():
                return
            try:
                self._open(services, request)
                self._computed(self.runner.compute_ahead(cancel))
            except Exception:
                log.info("could not prepare the first step of %s", request.task_id, exc_info=True)

        self._start(work, cancel, 0)

    def _start(self, work: Callable[[], None], cancel: threading.Event, step: int) -> None:
        self._ahead_step, self._ahead_took, self._ahead_started = step, None, time.perf_counter()
        self._ahead = threading.Thread(target=work, name=AHEAD_THREAD, daemon=True)
        _AHEAD[self._ahead] = cancel
        self._ahead.start()

    def _stop_ahead(self) -> None:
        """Cancel the next step's computation ahead, and wait for the model call it is in (whose result the step
        keeps) to end."""
        if self._ahead is not None:
            self._ahead_cancel.set()
            self._ahead.join()
            self._ahead = None

    def _computed(self, whole: bool) -> None:
        if whole and threading.current_thread() is self._ahead:  # not an earlier pick's work, still ending
            self._ahead_took = time.perf_counter() - self._ahead_started

    def ahead_status(self) -> AheadStatus:
        thread = self._ahead
        if thread is None:
            return AheadStatus("none")
        if thread.is_alive():
            return AheadStatus("computing", self._ahead_step, time.perf_counter() - self._ahead_started)
        if self._ahead_took is not None:
            return AheadStatus("ready", self._ahead_step, self._ahead_took)
        return AheadStatus("none")

    @property
    def computing_ahead(self) -> bool:
        return self._ahead is not None and self._ahead.is_alive()

    def wait_ahead(self, timeout: float | None = None) -> bool:
        """Wait until the computation ahead has ended (benchmarks and tests); True when it has."""
        if self._ahead is not None:
            self._ahead.join(timeout)
        return not self.computing_ahead

    def _record(self, ep: Episode, step: Step) -> None:
        if self.unjudged and ep.status == "finished":
            ep.success = None  # a typed instruction has no ground truth to judge against
        assert self.recorder is not None
        self.recorder(ep, step)
        if self.recorder.last_error:
            self.notices.append(f"Not saved yet: {self.recorder.last_error}")

    def ensure_runner(self, services: Services, request: RunRequest, report: Report | None = None) -> None:
        """Continue the episode when the request is unchanged; otherwise start a new one."""
        if report is not None and not services.is_loaded(request.model, request.adapter):
            # Said before waiting for the work ahead too: a picked task starts loading the model there.
            report(0.02, f"Loading model {request.model} (once)")  # the Run tab's message says how long
        self._stop_ahead()
        self._open(services, request, report)

    def _open(self, services: Services, request: RunRequest, report: Report | None = None) -> None:
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
        env = task_env(task) if task.id.startswith(INSTRUCTION_PREFIX) else None
        from app.engine import EpisodeRunner

        self.runner = EpisodeRunner(task, policy, request.settings, model=request.model, adapter=request.adapter,
                                    on_step=self._record, env=env, judge=judge, memory=services.memory())
        if request.settings.relevance > 0 and self.runner.settings.relevance == 0:
            self.notices.append(f"{NO_RELEVANCE} (tool relevance is off for this episode).")
        self.request = request
        self.view_step = None

    def resume(self, services: Services, episode_id: str) -> RunRequest:
        """Continue a stored episode that did not finish (interrupted, stopped or failed) in this
        session: its calls run again on a fresh environment, then Step carries on from there."""
        self._stop_ahead()
        try:
            ep = services.store.get_episode(episode_id)
        except StoreError as exc:
            raise InputError(str(exc)) from None
        if ep.task_id.startswith(TRACE_PREFIX):
            raise InputError(f"Episode {ep.id} is an imported trace: it cannot be continued, because its tools "
                             "answer only the calls it recorded (any new call would have no response).")
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

        self.runner = EpisodeRunner.resume(ep, task, policy, on_step=self._record, memory=services.memory())
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
        self._stop_ahead()
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
        self._stop_ahead()
        if self.runner is None or self.runner.done:
            return
        self.runner.stop()
        if self.episode.steps:
            self._save(services)

    def reset(self, services: Services) -> None:
        self._stop_ahead()
        self.close(services)
        self.resumed = False
        if self.runner is not None:
            self.runner.policy.reset_cache()  # the model's cached prompt prefixes go with the episode
        self.runner, self.recorder, self.request, self.view_step = None, None, None, None
        self.stop_requested.clear()

    def _fail(self, services: Services, exc: BaseException) -> None:
        self.runner.fail(str(exc))
        if self.episode.steps:
            self._save(services)

    def _save(self, services: Services) -> None:
        try:
            (self.recorder or Recorder(services.store)).flush(self.episode)
        except StoreError as exc:
            self.notices.append(f"Not saved: {exc}")

    def model_note(self) -> str:
        """What the model line adds about the model itself: how its server kept the constraints (`constraint_note`)."""
        return self.runner.policy.constraint_note if self.runner is not None else ""

    def take_notices(self) -> list[str]:
        out, self.notices = self.notices, []
        return out
