"""A `Constraint` as grammar text: the llguidance Lark grammar (the local decoder, vLLM's and SGLang's llguidance
backends) and GBNF (llama.cpp's server and llama-cpp-python, the `grammar` field). No torch: the HTTP path uses it.

Both say the same thing: `open + JSON + close`, or else (`allow_text`) a plain-text answer that does not start like a
call, with the separators `json.dumps` writes (`", "`, `": "`), so constrained output reads like the training
targets. Lark embeds the JSON schema (`%json {...}`); GBNF has no such directive, so `gbnf_text` writes the schema's
rules out, for the features `app.formats.grammar_schema` keeps: types, properties in their order (the required ones
always, the others optional), `additionalProperties`, items, enum, const, `maxLength`, anyOf, and `{}` (any JSON).
An open object's further keys (response schemas) are any
string but the listed keys, as llguidance's `%json` has them.
"""
from __future__ import annotations

import json
import re
from typing import Any

from .base import Constraint

JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""What `json.dumps` writes by default, which is also what the training targets are."""
TEXT_REGEX = r"/[^<{\s][^<]*/"
"""A plain-text answer: it may not start like a call (`<`, `{`) or with whitespace, nor contain `<`."""
TEXT_PATTERN = re.compile(r"[^<{\s][^<]*", re.DOTALL)
"""`TEXT_REGEX` in Python, to check an answer that took the text branch."""
LLGUIDANCE_PREFIX = "%llguidance {}\n"
"""What marks a Lark grammar as llguidance's where an engine reads several dialects (SGLang's `ebnf`)."""


def _lark_string(text: str) -> str:
    return json.dumps(text)  # Lark string literals use JSON's escapes


def grammar_text(constraint: Constraint) -> str:
    """The Lark grammar (llguidance dialect) of a constraint."""
    schema = {**constraint.schema, "x-guidance": JSON_STYLE}
    body = " ".join([_lark_string(constraint.open)] * bool(constraint.open) + ["json"]
                    + [_lark_string(constraint.close)] * bool(constraint.close))
    lines = [f"json: %json {json.dumps(schema, separators=(',', ':'))}"]
    if constraint.allow_text:
        lines.insert(0, "start: tagged | TEXT")
        lines += [f"tagged: {body}", f"TEXT: {TEXT_REGEX}"]
    else:
        lines.insert(0, f"start: {body}")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- GBNF

_GBNF_BASE = r"""
value ::= object-any | array-any | string | number | "true" | "false" | "null"
object-any ::= "{" ( string ": " value ( ", " string ": " value )* )? "}"
array-any ::= "[" ( value ( ", " value )* )? "]"
char ::= [^"\\\x7F\x00-\x1F] | "\\" ( ["\\/bfnrt] | "u" [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] )
string ::= "\"" char* "\""
integer ::= "-"? ( "0" | [1-9] [0-9]{0,15} )
number ::= integer ( "." [0-9]+ )? ( [eE] [-+]? [0-9]+ )?
boolean ::= "true" | "false"
null ::= "null"
text ::= [^<{ \t\n\r] [^<]*
""".strip()
_TYPE_ALIASES = {"dict": "object", "float": "number", "tuple": "array", "int": "integer", "bool": "boolean",
                 "str": "string"}


def _gbnf_literal(text: str) -> str:
    """A GBNF string literal: `"`, `\\` and control characters escaped."""
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ch == "\r":
            out.append("\\r")
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\x{ord(ch):02X}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _class_char(ch: str) -> str:
    """`ch` inside a GBNF character class."""
    return "\\" + ch if ch in "]^-\\[" else _gbnf_literal(ch)[1:-1]


class _Gbnf:
    """Rules for one schema, named `r0`, `r1`, ... (identical bodies share a rule)."""

    def __init__(self) -> None:
        self.rules: dict[str, str] = {}
        self._by_body: dict[str, str] = {}

    def rule(self, body: str) -> str:
        if body in self._by_body:
            return self._by_body[body]
        name = f"r{len(self.rules)}"
        self.rules[name] = body
        self._by_body[body] = name
        return name

    def value(self, schema: Any) -> str:
        """The expression (a rule name) of one schema."""
        if not isinstance(schema, dict) or not schema:
            return "value"
        if "const" in schema:
            return self.rule(_gbnf_literal(json.dumps(schema["const"], ensure_ascii=False)))
        if isinstance(schema.get("enum"), list) and schema["enum"]:
            return self.rule(" | ".join(_gbnf_literal(json.dumps(v, ensure_ascii=False)) for v in schema["enum"]))
        for key in ("anyOf", "oneOf"):
            if isinstance(schema.get(key), list) and schema[key]:
                return self.rule(" | ".join(self.value(s) for s in schema[key]))
        kind = schema.get("type")
        if isinstance(kind, list):
            return self.rule(" | ".join(self.value({**schema, "type": k}) for k in kind) or "value")
        kind = _TYPE_ALIASES.get(kind, kind)
        if kind == "string":
            limit = schema.get("maxLength")
            if isinstance(limit, int) and limit >= 0:
                return self.rule(f'"\\"" char{{0,{limit}}} "\\""')
            return "string"
        if kind in ("integer", "number", "boolean", "null"):
            return kind
        if kind == "array":
            item = self.value(schema.get("items"))
            return self.rule(f'"[" ( {item} ( ", " {item} )* )? "]"')
        if kind == "object" or "properties" in schema:
            return self._object(schema)
        return "value"

    def other_key(self, names: list[str]) -> str:
        """A JSON string that is none of `names` (an open object's further keys): a trie of the names, left at the
        first character off it; a name's own end is not an end."""
        keys = [json.dumps(n, ensure_ascii=False)[1:-1] for n in names]

        def node(prefix: str) -> str:
            nexts = sorted({k[len(prefix)] for k in keys if k.startswith(prefix) and len(k) > len(prefix)})
            alts = [] if prefix in keys else [r'"\""']
            alts += [f"{_gbnf_literal(c)} {node(prefix + c)}" for c in nexts]
            off = "".join(_class_char(c) for c in nexts)
            alts.append(r'( [^"\\\x7F\x00-\x1F' + off + r'] | "\\" ( ["\\/bfnrt] | "u" [0-9a-fA-F]{4} ) ) char* "\""')
            return self.rule(" | ".join(alts))

        return self.rule(r'"\"" ' + node(""))

    def _object(self, schema: dict[str, Any]) -> str:
        props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        if not props:
            return "object-any" if schema.get("additionalProperties") is not False else self.rule('"{" "}"')
        required = set(schema.get("required") or [])
        names = list(props)
        pairs = [self.rule(f'{_gbnf_literal(json.dumps(n, ensure_ascii=False))} ": " {self.value(props[n])}')
                 for n in names]
        key = self.other_key(names) if schema.get("additionalProperties") is not False else ""
        # tail(i, comma): the properties from the i-th on, in order (the required ones always); `comma`: one was
        # written before. Returns (expression, whether it may be empty); GBNF has no empty literal, so an empty
        # alternative is written as an optional group.
        memo: dict[tuple[int, bool], tuple[str, bool]] = {}

        def tail(i: int, comma: bool) -> tuple[str, bool]:
            if (i, comma) in memo:
                return memo[(i, comma)]
            if i == len(names):  # past the listed ones: more keys where the schema allows them
                sep = '", " ' if comma else ""
                out = (f'( {sep}{key} ": " value ( ", " {key} ": " value )* )?', True) if key else ("", True)
                memo[(i, comma)] = out
                return out
            sep = '", " ' if comma else ""
            rest, _ = tail(i + 1, True)
            take = f"{sep}{pairs[i]}" + (f" {rest}" if rest else "")
            if names[i] in required:
                out = (self.rule(take), False)
            else:
                skip, skip_empty = tail(i + 1, comma)
                if not skip:
                    out = (self.rule(f"( {take} )?"), True)
                elif skip_empty:
                    out = (self.rule(f"( {take} | {skip} )?"), True)  # `skip` may be empty: so may this
                else:
                    out = (self.rule(f"{take} | {skip}"), False)
            memo[(i, comma)] = out
            return out

        body, _ = tail(0, False)
        return self.rule(f'"{{" {body} "}}"' if body else '"{" "}"')


def gbnf_text(constraint: Constraint) -> str:
    """The GBNF grammar (llama.cpp) of a constraint; the root is `root`."""
    g = _Gbnf()
    json_rule = g.value(constraint.schema)
    parts = [_gbnf_literal(constraint.open)] * bool(constraint.open) + [json_rule] \
        + [_gbnf_literal(constraint.close)] * bool(constraint.close)
    tagged = " ".join(parts)
    root = f"root ::= {tagged} | text" if constraint.allow_text else f"root ::= {tagged}"
    rules = [root] + [f"{name} ::= {body}" for name, body in g.rules.items()]
    return "\n".join(rules) + "\n" + _GBNF_BASE + "\n"


__all__ = ["JSON_STYLE", "LLGUIDANCE_PREFIX", "TEXT_PATTERN", "TEXT_REGEX", "gbnf_text", "grammar_text"]
