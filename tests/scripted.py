"""A scripted policy: implements the Policy interface from canned text, for engine unit tests.

It never stands where the product uses a model; it exists so the engine's control flow
(branching, dedup, selection, shadow execution, storage) is tested in milliseconds.
"""
from __future__ import annotations

import json
from typing import Any, Callable

from model_backend.base import Generation, GenerationConfig, Policy, Prompt


class ScriptedPolicy(Policy):
    name = "scripted"
    context_window = 8192

    def __init__(self, actions: list[list[str]], predict: Callable[[str], Any] | None = None,
                 judge: Callable[[str], float] | None = None, name_scores: dict[str, float] | None = None,
                 arguments: dict[str, dict[str, Any]] | None = None,
                 relevance: dict[str, float] | None = None) -> None:
        """`actions[i]` are the candidates of the i-th act() call (padded by repeating the last).
        `name_scores`: the log-probability `score` gives a tool name (the `tools` proposal ranks by it);
        `arguments`: what `act_each` writes for a call forced onto a tool (default none);
        `relevance`: the log-probability `score` gives the request after a tool's channel prompt (default -5)."""
        self.actions = list(actions)
        self.name_scores = name_scores or {}
        self.arguments = arguments or {}
        self.relevance = relevance or {}
        self.relevance_calls = 0
        self.act_each_calls: list[list[Prompt]] = []
        self.predict = predict or (lambda prompt_text: {"ok": True})
        self.judge = judge or (lambda prompt_text: 0.5)
        self.act_calls: list[tuple[Prompt, int]] = []
        self.rehearse_calls: list[list[Prompt]] = []

    def count_tokens(self, text: str) -> int:
        return max(1, len(text) // 4)

    def act(self, prompt: Prompt, k: int, config: GenerationConfig) -> list[Generation]:
        self.act_calls.append((prompt, k))
        script = self.actions.pop(0) if self.actions else ["Done."]
        out = []
        for i in range(k):
            text = script[min(i, len(script) - 1)]
            out.append(Generation(text=prompt.prefill + text if not text.startswith(prompt.prefill) else text,
                                  token_logprobs=[-0.1 * (i + 1)] * 4, sampled=i > 0))
        return out

    def act_each(self, prompts: list[Prompt], config: GenerationConfig) -> list[Generation]:
        """A call to the tool each prompt is forced onto (its constraint's one name, or the name in its prefill)."""
        self.act_each_calls.append(prompts)
        out = []
        for p in prompts:
            if p.constraint is not None:
                name = p.constraint.schema["properties"]["name"]["const"]
                body = json.dumps({"name": name, "arguments": self.arguments.get(name, {})}) + "</tool_call>"
            else:
                name = p.prefill.split('"name": "')[1].split('"')[0]
                body = json.dumps(self.arguments.get(name, {})) + "}</tool_call>"
            out.append(Generation(text=p.prefill + body, token_logprobs=[-0.3] * 4, sampled=False))
        return out

    def rehearse(self, prompts: list[Prompt], config: GenerationConfig) -> list[Generation]:
        self.rehearse_calls.append(prompts)
        out = []
        for p in prompts:
            value = self.predict(p.messages[-1]["content"])
            text = value if isinstance(value, str) else json.dumps(value)
            out.append(Generation(text=f"{p.prefill}{text}</execution_result>", token_logprobs=[-0.2]))
        return out

    def score(self, prompts: list[Prompt], continuations: list[str]) -> list[list[float]]:
        import math

        out = []
        if prompts and prompts[0].messages[-1]["content"].startswith("Tool `"):
            self.relevance_calls += 1
        for p, c in zip(prompts, continuations):
            content = p.messages[-1]["content"]
            if content.startswith("Tool `"):  # the noisy channel's prompt (`proposals.relevance`)
                out.append([self.relevance.get(content.split("`")[1], -5.0)])
            elif c in ("yes", "no"):
                p_yes = min(max(self.judge(p.messages[-1]["content"]), 1e-6), 1 - 1e-6)
                out.append([math.log(p_yes if c == "yes" else 1 - p_yes)])
            elif c.endswith('"') and c[:-1] in self.name_scores:  # a tool name, for the `tools` proposal
                out.append([self.name_scores[c[:-1]]])
            else:
                out.append([-0.5] * max(1, len(c) // 4))
        return out


# A scripted mock:kv episode (parallel K=2, logprob selector), shared by the training, fine-tune and kill tests.

def call(name: str, **arguments) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


SCRIPT = [[call("set", key="color", value="blue"), call("list_keys")], ["Stored."],
          [call("delete", key="size")], [call("get", key="color")], ["It is blue."]]


def mock_episode(settings: "RunSettings | None" = None, store: "Store | None" = None):
    """Run SCRIPT on `mock:kv` to its end (recorded in `store` if given): (task, policy, episode)."""
    from app import envs
    from app.engine import EpisodeRunner
    from app.records import RunSettings
    from app.store import Recorder

    task = envs.load_task("mock:kv")
    policy = ScriptedPolicy([list(s) for s in SCRIPT], predict=lambda text: {"ok": True})
    recorder = Recorder(store) if store is not None else None
    runner = EpisodeRunner(task, policy, settings or RunSettings(mode="parallel", branches=2, selector="logprob"),
                           on_step=recorder)
    if recorder:
        recorder.start(runner.episode)
    runner.run_all()
    if recorder:
        recorder.flush(runner.episode)
    return task, policy, runner.episode



def stored_mock_episode(path) -> tuple["Store", "ScriptedPolicy", "Episode"]:
    """`mock_episode` recorded in a fresh store at `path`/t.db: (store, policy, episode)."""
    from app.store import Store

    store = Store(path / "t.db")
    _, policy, ep = mock_episode(store=store)
    return store, policy, ep


def branch_ids(store: "Store", episode_id: str, kind: str = "call") -> list[int]:
    """The stored ids of an episode's branches of one kind (`call`, `answer`, `parse_error`)."""
    return [r["id"] for r in store.branch_rows(episode_id) if r["kind"] == kind]

class AheadPolicy(ScriptedPolicy):
    """Keeps what it computes ahead, as TransformersPolicy does: Step then takes it without computing again.
    `work()` stands for the model's compute, ahead or at Step (a fake clock's advance, or real seconds)."""

    can_compute_ahead = True

    def __init__(self, work: Callable[[], None], *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.work, self.ahead, self.kept = work, False, {}

    def computing_ahead(self, stop: Callable[[], bool] = lambda: False) -> Any:
        import contextlib

        @contextlib.contextmanager
        def on() -> Any:
            self.ahead = True
            try:
                yield
            finally:
                self.ahead = False
        return on()

    def act(self, prompt: Prompt, k: int, config: GenerationConfig) -> list[Generation]:
        key = json.dumps([prompt.messages, prompt.prefill, k])
        if key in self.kept:
            return self.kept.pop(key) if not self.ahead else self.kept[key]
        self.work()
        out = super().act(prompt, k, config)
        if self.ahead:
            self.kept[key] = out
        return out
