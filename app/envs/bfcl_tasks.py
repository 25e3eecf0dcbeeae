"""BFCL multi-turn data: tasks, splits, tool docs and ground-truth call strings.

Everything here reads the files that the `bfcl-eval` package ships; nothing executes.
"""
from __future__ import annotations

import ast
import copy
import functools
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.envs.base import Task, Tool

SUITE = "bfcl"
CATEGORIES: tuple[str, ...] = (
    "multi_turn_base",
    "multi_turn_miss_func",
    "multi_turn_miss_param",
    "multi_turn_long_context",
)
TRAIN_CATEGORY = "multi_turn_base"
SPLITS: tuple[str, ...] = ("train", "heldout")
# BFCL's own text for the turn at which held-out functions come back (miss_func).
ADDITIONAL_FUNCTION_PROMPT = (
    "I have updated some more functions you can choose from. What about now?"
)

# Class name -> (module in func_source_code, function-doc file).
CLASS_SOURCES: dict[str, tuple[str, str]] = {
    "GorillaFileSystem": ("gorilla_file_system", "gorilla_file_system.json"),
    "MathAPI": ("math_api", "math_api.json"),
    "MessageAPI": ("message_api", "message_api.json"),
    "TwitterAPI": ("posting_api", "posting_api.json"),
    "TicketAPI": ("ticket_api", "ticket_api.json"),
    "TradingBot": ("trading_bot", "trading_bot.json"),
    "TravelAPI": ("travel_booking", "travel_booking.json"),
    "VehicleControlAPI": ("vehicle_control", "vehicle_control.json"),
}

# Read-only rule: a tool is read-only when calling it changes no attribute of its
# instance, public or private (so not `cd`, which moves the private current directory,
# nor tools that draw from the instance's RNG such as `get_current_speed`, nor
# `get_flight_cost`, which rewrites a private price cache), and it models no effect in
# the world (so not `contact_customer_support`). Decided by reading the 2026.3.23
# sources; `tests/test_envs_bfcl.py` re-checks it on every ground-truth call.
READ_ONLY_TOOLS: dict[str, frozenset[str]] = {
    "GorillaFileSystem": frozenset(
        {"pwd", "ls", "cat", "find", "wc", "sort", "grep", "du", "tail", "diff"}
    ),
    "MathAPI": frozenset(
        {
            "logarithm", "mean", "standard_deviation", "si_unit_conversion",
            "imperial_si_conversion", "add", "subtract", "multiply", "divide", "power",
            "square_root", "absolute_value", "round_number", "percentage", "min_value",
            "max_value", "sum_values",
        }
    ),
    "MessageAPI": frozenset(
        {
            "list_users", "get_user_id", "message_get_login_status",
            "view_messages_sent", "search_messages", "get_message_stats",
        }
    ),
    "TwitterAPI": frozenset(
        {
            "posting_get_login_status", "list_all_following", "get_tweet",
            "get_user_tweets", "search_tweets", "get_tweet_comments", "get_user_stats",
        }
    ),
    "TicketAPI": frozenset({"get_ticket", "ticket_get_login_status", "get_user_tickets"}),
    "TradingBot": frozenset(
        {
            "get_current_time", "get_symbol_by_name", "get_stock_info",
            "get_order_details", "get_account_info", "trading_get_login_status",
            "get_watchlist", "get_order_history", "get_transaction_history",
            "get_available_stocks", "filter_stocks_by_price", "notify_price_change",
        }
    ),
    "TravelAPI": frozenset(
        {
            "travel_get_login_status", "get_budget_fiscal_year", "get_credit_card_balance",
            "retrieve_invoice", "get_booking_history", "list_all_airports",
            "compute_exchange_rate", "verify_traveler_information",
            "get_nearest_airport_by_city", "get_all_credit_cards",
        }
    ),
    "VehicleControlAPI": frozenset(
        {
            "displayCarStatus", "display_log", "estimate_drive_feasibility_by_mileage",
            "liter_to_gallon", "gallon_to_liter", "estimate_distance",
            "get_zipcode_based_on_city", "check_tire_pressure", "find_nearest_tire_shop",
            "get_outside_temperature_from_weather_com",
        }
    ),
}

# BFCL's type names -> JSON schema. "any" becomes an unconstrained schema.
_TYPE_MAP: dict[str, str | None] = {
    "dict": "object",
    "object": "object",
    "float": "number",
    "number": "number",
    "integer": "integer",
    "int": "integer",
    "string": "string",
    "str": "string",
    "boolean": "boolean",
    "bool": "boolean",
    "array": "array",
    "list": "array",
    "tuple": "array",
    "any": None,
}
_DESCRIPTION_MARK = "Tool description:"
_TASK_ID_RE = re.compile(r"^(?:bfcl:)?(multi_turn_[a-z_]+?)_(\d+)$")


class UnknownTaskError(ValueError):
    """A task id or category that no suite knows."""


def data_dir() -> Path:
    """The `bfcl_eval/data` folder of the installed package."""
    import bfcl_eval  # light: the package's __init__ is empty

    return Path(bfcl_eval.__file__).parent / "data"


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    with path.open(encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


@functools.lru_cache(maxsize=None)
def _entries(category: str) -> tuple[dict[str, Any], ...]:  # multi-turn and single-turn files alike
    """Parsed task entries of one category, each with its `ground_truth` merged in."""
    root = data_dir()
    rows = _read_jsonl(root / f"BFCL_v4_{category}.json")
    answers = {a["id"]: a["ground_truth"] for a in _read_jsonl(root / "possible_answer" / f"BFCL_v4_{category}.json")}
    for row in rows:
        row["ground_truth"] = answers[row["id"]]
    return tuple(rows)


SINGLE_TURN_CATEGORIES: tuple[str, ...] = ("multiple", "live_multiple")
"""BFCL single-turn categories where one call must be chosen among several documented functions:
tool-selection examples on other APIs than the multi-turn classes (never evaluated here)."""


@dataclass(frozen=True)
class SingleTurnExample:
    """One single-turn BFCL entry with one expected call: the request, the tools offered, the call."""

    id: str
    request: str
    tools: tuple[Tool, ...]
    name: str
    arguments: dict[str, Any]


def _flat(value: Any) -> bool:
    return not isinstance(value, (dict, list)) or (isinstance(value, list) and
                                                   all(not isinstance(v, (dict, list)) for v in value))


def single_turn_examples(category: str) -> list[SingleTurnExample]:
    """The entries of a single-turn category whose answer is one call with plain argument values.

    BFCL lists the acceptable values of each argument; the first is taken, and an argument whose
    first acceptable value is "" (may be omitted) is left out. Entries with nested answers (a dict
    of acceptable values inside an argument), several calls or several user messages are skipped.
    """
    if category not in SINGLE_TURN_CATEGORIES:
        raise UnknownTaskError(f"unknown single-turn category {category!r}; known: {', '.join(SINGLE_TURN_CATEGORIES)}")
    out = []
    for entry in _entries(category):
        answers, question = entry["ground_truth"], entry["question"]
        if len(answers) != 1 or len(question) != 1 or len(question[0]) != 1 or question[0][0]["role"] != "user":
            continue
        (name, accepted), = answers[0].items()
        if not all(values and _flat(values[0]) for values in accepted.values()):
            continue
        tools = tuple(Tool(f["name"], f.get("description", ""), _to_json_schema(f.get("parameters", {})))
                      for f in entry["function"])
        chosen = next((t for t in tools if t.name == name), None)
        if chosen is None:
            continue
        given = {k: values[0] for k, values in accepted.items() if values[0] != ""}
        order = list(chosen.parameters.get("properties", {}))  # the order the constrained Act writes
        arguments = {k: given[k] for k in order if k in given} | {k: v for k, v in given.items() if k not in order}
        out.append(SingleTurnExample(entry["id"], question[0][0]["content"], tools, name, arguments))
    return out


def _unknown(what: str) -> UnknownTaskError:
    return UnknownTaskError(f"{what}; valid categories: {', '.join(CATEGORIES)} (ids like bfcl:multi_turn_base_12)")


def _parse_task_id(task_id: str) -> tuple[str, int]:
    match = _TASK_ID_RE.match(task_id)
    if not match or match.group(1) not in CATEGORIES:
        raise _unknown(f"unknown BFCL task id {task_id!r}")
    return match.group(1), int(match.group(2))


def task_split(task_id: str) -> str:
    """`train` or `heldout` (index mod 4 == 3), in every multi-turn category: the four categories are variants
    of the same 200 scenarios index for index, so the same rule keeps a held-out scenario held out everywhere
    (its ground truth never reaches training rows or the rehearsal memory's seed)."""
    _, index = _parse_task_id(task_id)
    return "heldout" if index % 4 == 3 else "train"


def list_tasks(category: str | None = None, split: str | None = None) -> list[str]:
    """Task ids, optionally of one category and/or one split (`train`, `heldout`)."""
    if category is not None and category not in CATEGORIES:
        raise _unknown(f"unknown BFCL category {category!r}")
    if split is not None and split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; valid splits: {', '.join(SPLITS)}")
    ids: list[str] = []
    for cat in [category] if category else CATEGORIES:
        for entry in _entries(cat):
            task_id = f"{SUITE}:{entry['id']}"
            if split is None or task_split(task_id) == split:
                ids.append(task_id)
    return ids


def load_task(task_id: str) -> Task:
    """The Task for an id such as `bfcl:multi_turn_base_12` (the prefix is optional)."""
    category, index = _parse_task_id(task_id)
    wanted = f"{category}_{index}"
    entry = next((e for e in _entries(category) if e["id"] == wanted), None)
    if entry is None:
        raise _unknown(f"no BFCL task {task_id!r}")
    entry = copy.deepcopy(entry)  # the cache must never be mutated through a Task
    ground_truth: list[list[str]] = entry["ground_truth"]
    longest_turn = max((len(turn) for turn in ground_truth), default=0)
    return Task(
        id=f"{SUITE}:{wanted}",
        category=category,
        turns=entry["question"],
        env_classes=list(entry["involved_classes"]),
        initial_config=entry.get("initial_config", {}),
        excluded_functions=list(entry.get("excluded_function", [])),
        ground_truth=ground_truth,
        # Room for one exploratory or failed call per gold call.
        max_steps_per_turn=max(4, 2 * longest_turn),
        extra={
            "missed_function": entry.get("missed_function", {}),
            "additional_function_prompt": ADDITIONAL_FUNCTION_PROMPT if entry.get("missed_function") else None,
            "long_context": category == "multi_turn_long_context",
            "path": entry.get("path", []),
            "split": task_split(wanted),
        },
    )


def _to_json_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """Map one BFCL parameter schema (recursively) onto JSON schema."""
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "type":
            mapped = _TYPE_MAP.get(str(value), str(value))
            if mapped is not None:
                out["type"] = mapped
        elif key == "properties" and isinstance(value, dict):
            out["properties"] = {name: _to_json_schema(sub) for name, sub in value.items()}
        elif key == "items" and isinstance(value, dict):
            out["items"] = _to_json_schema(value)
        else:
            out[key] = value
    return out


def _short_description(text: str) -> str:
    """Drop the class preamble that BFCL repeats in every tool description."""
    _, mark, rest = text.partition(_DESCRIPTION_MARK)
    return rest.strip() if mark else text.strip()


@functools.lru_cache(maxsize=None)
def class_tools(class_name: str) -> tuple[Tool, ...]:
    """All documented tools of one BFCL class (shared objects: do not mutate)."""
    if class_name not in CLASS_SOURCES:
        raise UnknownTaskError(f"unknown BFCL class {class_name!r}; known: {', '.join(CLASS_SOURCES)}")
    doc_file = data_dir() / "multi_turn_func_doc" / CLASS_SOURCES[class_name][1]
    read_only = READ_ONLY_TOOLS[class_name]
    tools = []
    for doc in _read_jsonl(doc_file):
        params = _to_json_schema(doc.get("parameters") or {"type": "object", "properties": {}})
        params.setdefault("properties", {})
        params.setdefault("required", [])
        response = doc.get("response")
        tools.append(
            Tool(
                name=doc["name"],
                description=_short_description(doc.get("description", "")),
                parameters=params,
                response=_to_json_schema(response) if response else None,
                read_only=doc["name"] in read_only,
                env_class=class_name,
            )
        )
    return tuple(tools)


def parse_call_string(
    call: str, param_names: Callable[[str], Sequence[str]] | None = None
) -> tuple[str, dict[str, Any]]:
    """Parse `mv(source='a', destination='b')` into `("mv", {...})` with `ast`, never `eval`.

    Values must be literals (negative numbers, nested lists/dicts/tuples included).
    Positional arguments are named by `param_names(tool_name)` when given.
    """
    try:
        node = ast.parse(call.strip(), mode="eval").body
    except SyntaxError as exc:
        raise ValueError(f"not a call: {call!r} ({exc.msg})") from None
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        raise ValueError(f"not a plain function call: {call!r}")
    name = node.func.id
    args: dict[str, Any] = {}
    if node.args:
        names = list(param_names(name)) if param_names else []
        if len(node.args) > len(names):
            raise ValueError(f"cannot name the positional arguments of {call!r}")
        for param, value in zip(names, node.args):
            args[param] = _literal(value, call)
    for keyword in node.keywords:
        if keyword.arg is None:
            raise ValueError(f"**kwargs are not supported: {call!r}")
        args[keyword.arg] = _literal(keyword.value, call)
    return name, args


def _literal(node: ast.expr, call: str) -> Any:
    try:
        value = ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        raise ValueError(f"non-literal argument in {call!r}: {ast.unparse(node)}") from None
    return _lists_for_tuples(value)


def _lists_for_tuples(value: Any) -> Any:
    """Tuples and sets become lists so that parsed arguments are JSON values."""
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_lists_for_tuples(v) for v in value]
    if isinstance(value, dict):
        return {k: _lists_for_tuples(v) for k, v in value.items()}
    return value
