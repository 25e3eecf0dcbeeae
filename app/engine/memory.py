"""The rehearsal memory: real (call, response) transitions, retrieved into Rehearse prompts.

EnvACE's own Rehearse prompt carries "previous tool calls and results (few-shot)": real pairs of the same
tool, with the instruction to reuse a result when the call matches. Here every real response the app sees
becomes a `Transition` (the seed: replays of the training split's ground truth and calls explored from its
states; then every committed call, every shadow execution, imported traces and annotators' corrections),
kept in SQLite (`Store.add_transitions`) so it survives restarts, and indexed here by tool.

For a call to rehearse, `retrieve` ranks the admitted transitions of the same tool: an exact call match
first, then BM25 (`bm25s`) over the canonical arguments' tokens (argument values as words, and each value
whole under its argument's name), newer first among equals; the same (call, response) is shown once.

`MemoryScope` says what a rehearsal may see (`RunSettings.memory`): `off`; `seed` (only the training
split's replays and explorations, and what the same episode observed); `online` (everything). Evaluation excludes the evaluated task's own
transitions (its ground truth, an earlier row's episode of it) unless the same episode observed them
(`exclude_task`), so no figure is measured on what it retrieves.
"""
from __future__ import annotations

import logging
import re
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Sequence

from app.envs.base import Tool
from app.formats import canonical_call, canonical_json
from app.records import Call, MemoryHit, MemoryMode, Step, Transition

if TYPE_CHECKING:
    from app.store import Store

SEED_SOURCES = ("expert", "explore")
"""Transitions from the training split's tasks, made before any episode: what `seed` admits."""
_WORD = re.compile(r"[a-z0-9]+")


@dataclass(frozen=True)
class MemoryScope:
    """Which transitions one episode's rehearsals may retrieve."""

    mode: MemoryMode = "online"
    task_id: str | None = None
    episode_id: str | None = None
    exclude_task: bool = False
    """Leave out transitions of `task_id`'s scenario (`scenario_of`) that another episode observed (or a replay of
    its ground truth): evaluation sets it, so a task is never rehearsed with its own answers, and training rows
    retrieve as evaluation will (no memory that knows the row's answer)."""

    def admits(self, t: Transition) -> bool:
        if self.mode == "off":
            return False
        if self.episode_id is not None and t.episode_id == self.episode_id:
            return True  # observed earlier in this very episode: fair in every mode
        if self.mode == "seed" and not (t.source in SEED_SOURCES and t.split == "train"):
            return False
        return not (self.exclude_task and self.task_id is not None and t.task_id is not None
                    and scenario_of(t.task_id) == scenario_of(self.task_id))


_BFCL_SCENARIO = re.compile(r"^bfcl:multi_turn_[a-z_]+?_(\d+)$")


def scenario_of(task_id: str) -> str:
    """What a task shares its ground truth with: BFCL's four multi-turn categories are variants of the same 200
    scenarios index for index (`bfcl:multi_turn_base_3` and `bfcl:multi_turn_miss_param_3` start from the same
    state and make the same calls), so excluding a task excludes its scenario; any other task is its own."""
    match = _BFCL_SCENARIO.match(task_id)
    return f"bfcl:scenario_{match.group(1)}" if match else task_id


def _tokens(arguments: dict[str, Any]) -> list[str]:
    """A call's retrieval tokens: each argument's value whole under its name, and its words."""
    out: list[str] = []
    for key, value in sorted(arguments.items()):
        text = value if isinstance(value, str) else canonical_json(value)
        out.append(f"{key}={text.lower()}")
        out += _WORD.findall(text.lower())
    return out


def _key(t: Transition) -> tuple[str, str, str, str, str]:
    """What makes a transition new (the store's unique index): an episode keeps its own observations."""
    return (canonical_call(Call(name=t.tool, arguments=t.arguments)), canonical_json(t.response), t.source,
            t.task_id or "", t.episode_id or "")


class _ToolIndex:
    """The transitions of one tool and their BM25 index (rebuilt when transitions were added)."""

    def __init__(self) -> None:
        self.items: list[Transition] = []
        self.calls: list[str] = []
        self._bm25: Any = None

    def add(self, t: Transition) -> None:
        self.items.append(t)
        self.calls.append(canonical_call(Call(name=t.tool, arguments=t.arguments)))
        self._bm25 = None

    def scores(self, arguments: dict[str, Any]) -> list[float]:
        query = _tokens(arguments)
        if not query or not self.items:
            return [0.0] * len(self.items)
        if self._bm25 is None:
            import bm25s  # numpy only; kept out of import time

            logging.getLogger("bm25s").setLevel(logging.WARNING)  # it logs every index build at DEBUG

            corpus = [_tokens(t.arguments) or ["<none>"] for t in self.items]
            self._bm25 = bm25s.BM25()
            self._bm25.index(corpus, show_progress=False)
        return [float(s) for s in self._bm25.get_scores(query)]


class RehearsalMemory:
    """Real transitions by tool, written through to a `Store` when one is given. Thread-safe."""

    def __init__(self, store: "Store | None" = None, transitions: Iterable[Transition] = ()) -> None:
        self.store = store
        self._tools: dict[str, _ToolIndex] = {}
        self._keys: set[tuple[str, str, str, str, str]] = set()
        self._lock = threading.Lock()
        self._index(list(transitions))

    @classmethod
    def from_store(cls, store: "Store") -> "RehearsalMemory":
        """Everything the store holds (the seed and what earlier sessions observed)."""
        return cls(store, store.transitions())

    def transitions(self) -> list[Transition]:
        """Every transition held, in the order they were added per tool."""
        with self._lock:
            return [t for index in self._tools.values() for t in index.items]

    def detached(self, limit: int | None = None) -> "RehearsalMemory":
        """An in-memory copy that writes nothing to the store (what a measurement adds stays out of the product's
        memory); `limit` keeps the first `limit` transitions (the memory-size curve)."""
        held = self.transitions()
        return RehearsalMemory(None, held if limit is None else held[:limit])

    def __len__(self) -> int:
        return len(self._keys)

    def counts(self) -> dict[str, int]:
        """Transitions held, by source."""
        out: dict[str, int] = {}
        with self._lock:
            for index in self._tools.values():
                for t in index.items:
                    out[t.source] = out.get(t.source, 0) + 1
        return out

    def _index(self, transitions: list[Transition]) -> list[Transition]:
        added = []
        with self._lock:
            for t in transitions:
                key = _key(t)
                if key in self._keys:
                    continue
                self._keys.add(key)
                self._tools.setdefault(t.tool, _ToolIndex()).add(t)
                added.append(t)
        return added

    def add(self, transitions: list[Transition]) -> list[Transition]:
        """Remember real transitions (written to the store first, so a restart keeps them); returns the new ones."""
        fresh = [t for t in transitions if _key(t) not in self._keys]
        if not fresh:
            return []
        if self.store is not None:
            fresh = self.store.add_transitions(fresh)
        return self._index(fresh)

    def retrieve(self, call: Call, scope: MemoryScope, k: int, recent: Sequence[Transition] = ()) -> list[MemoryHit]:
        """The `k` most similar admitted transitions of `call`'s tool, most similar first.

        `recent`: transitions the episode observed that the memory does not hold (a replayed or forced episode,
        whose calls are not written): they rank as the episode's own, an exact call match first, newest next."""
        if k <= 0 or scope.mode == "off":
            return []
        wanted = canonical_call(call)
        own = [(canonical_call(Call(name=t.tool, arguments=t.arguments)) == wanted, i, t)
               for i, t in enumerate(recent) if t.tool == call.name]
        own.sort(key=lambda x: (x[0], x[1]), reverse=True)
        first = [MemoryHit(id=t.id, tool=t.tool, arguments=t.arguments, response=t.response, error=t.error,
                           source=t.source, task_id=t.task_id, score=1e6)
                 for _, _, t in own][:k]
        if len(first) == k:
            return first
        rest = self._retrieve(call, scope, k + len(first))
        shown = {(canonical_call(Call(name=h.tool, arguments=h.arguments)), canonical_json(h.response)) for h in first}
        for h in rest:
            pair = (canonical_call(Call(name=h.tool, arguments=h.arguments)), canonical_json(h.response))
            if pair not in shown and len(first) < k:
                shown.add(pair)
                first.append(h)
        return first

    def _retrieve(self, call: Call, scope: MemoryScope, k: int) -> list[MemoryHit]:
        with self._lock:
            index = self._tools.get(call.name)
            if index is None:
                return []
            admitted = [i for i, t in enumerate(index.items) if scope.admits(t)]
            if not admitted:
                return []
            scores = index.scores(call.arguments)
            wanted = canonical_call(call)
            def rank(i: int) -> tuple:
                t = index.items[i]
                same_episode = scope.episode_id is not None and t.episode_id == scope.episode_id
                exact = index.calls[i] == wanted
                # A person's correction of this very call outranks what was observed of it.
                return (exact, exact and t.source == "correction", same_episode, t.source != "explore", not t.error,
                        scores[i], i)

            ranked = sorted(admitted, key=rank, reverse=True)
            hits, shown = [], set()
            for i in ranked:
                t = index.items[i]
                pair = (index.calls[i], canonical_json(t.response))
                if pair in shown:
                    continue
                shown.add(pair)
                score = 1e6 if index.calls[i] == wanted else scores[i]
                hits.append(MemoryHit(id=t.id, tool=t.tool, arguments=t.arguments, response=t.response, error=t.error,
                                      source=t.source, task_id=t.task_id, score=round(score, 4)))
                if len(hits) == k:
                    break
            return hits


def observed(step: Step, *, task_id: str | None, split: str | None, episode_id: str | None,
             tools: dict[str, Tool]) -> list[Transition]:
    """The real transitions one step observed: its committed call and every shadow execution."""
    out = []
    for b in step.branches:
        if b.kind != "call" or b.call is None or b.actual_source is None:
            continue
        tool = tools.get(b.call.name)
        if tool is None:  # an unknown tool's error says nothing about a tool
            continue
        out.append(Transition(tool=b.call.name, arguments=b.call.arguments, response=b.actual,
                              error=bool(b.actual_error), read_only=tool.read_only, env_class=tool.env_class,
                              source=b.actual_source, task_id=task_id, split=split, episode_id=episode_id,
                              step=step.index, branch=b.index))
    return out


def corrected(call: Call, response: Any, *, tool: Tool | None, task_id: str | None, split: str | None,
              episode_id: str | None, step: int, branch: int) -> Transition:
    """An annotator's corrected response of `call` as a transition (source `correction`): what the rehearsal
    memory takes in the moment the correction is saved."""
    return Transition(tool=call.name, arguments=call.arguments, response=response,
                      error=isinstance(response, dict) and "error" in response,
                      read_only=bool(tool and tool.read_only), env_class=tool.env_class if tool else "",
                      source="correction", task_id=task_id, split=split, episode_id=episode_id, step=step,
                      branch=branch)


__all__ = ["MemoryScope", "RehearsalMemory", "SEED_SOURCES", "corrected", "observed", "scenario_of"]
