"""What a running OpenEnv server offers, learned from the server itself, as TRL tools.

Two kinds of OpenEnv environment exist upstream:
  * MCP tool envs (`MCPEnvironment`, action class `CallToolAction`): `/schema`'s action has
    `tool_name` + `arguments`; a `{"type": "list_tools"}` step lists the tools with JSON schemas.
    Each MCP tool becomes one TRL tool.
  * typed-action envs (an `Action` subclass, e.g. Connect4's `column: int`): one TRL tool whose
    arguments are the action's fields.

Every argument's JSON schema maps to a Python type hint that `transformers.utils.get_json_schema`
(what TRL's `environment_factory` renders tools with) turns back into the same JSON schema. A schema
it cannot express raises `UnsupportedSchema` naming the tool and the field.
"""

from __future__ import annotations

import keyword
import re
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

from envs.core import untrusted


# Fields every OpenEnv `Action` carries that are not the env's own (set by the framework, not the policy).
FRAMEWORK_ACTION_FIELDS = ("metadata",)
# Names a learned tool must not take: the env class's own methods (TRL calls reset/get_reward) and the attributes
# trainer.rollouts.envs_binding gives every bound class; a tool by one of these names would replace it.
RESERVED_TOOL_NAMES = ("reset", "get_reward", "env_name", "replica_set")
# What an env server may make us parse (a third-party image): bounded, so a hostile /schema cannot stall preflight.
MAX_SCHEMA_NODES = 20_000  # after $refs are inlined
MAX_DESCRIPTION_CHARS = 1_000
MAX_TOOL_PARAMS = 64  # every argument is written into every prompt; past this the model could not use the tool
MAX_TOOLS = 64  # the same for tools: each one's schema is in every prompt (#44: 20,000 were accepted)
MAX_NAME_CHARS = 64  # a tool or argument name (#44: a 300,000-character name was accepted)
MAX_SCHEMA_DEPTH = 64  # levels once $refs are inlined: type_hint recurses over them
MAX_REF_LINKS = 32  # $refs followed along one path: a 600-link chain ended in RecursionError
ARG_SECTIONS = ("args", "arguments", "attributes", "parameters", "params")
SECTION_HEADERS = (*ARG_SECTIONS, "returns", "return", "raises", "yields", "examples", "example", "note", "notes")


class InterfaceError(RuntimeError):
    """The server cannot be used as an OpenEnv env (not one, or unreachable): one line, with the fix."""


class NoActionSchema(InterfaceError):
    """GET /schema answered without an OpenEnv action schema (not an OpenEnv server, or one serving only HTTP)."""


class UnsupportedSchema(InterfaceError):
    """A tool argument TRL's schema builder cannot express, or an action without fields."""


@dataclass(frozen=True)
class Param:
    name: str
    hint: Any  # Python type hint; get_json_schema renders it back to `schema`'s type
    description: str
    required: bool
    schema: dict = field(hash=False, compare=False)  # the field's JSON schema ($refs resolved)
    # the env's own value of each enum/const string the model is shown otherwise (neutralised: `shown_value`)
    originals: dict = field(default_factory=dict, hash=False, compare=False)

    def env_value(self, value: Any) -> Any:
        """`value` as the env expects it: an enum/const string the model could only write neutralised, the env's own."""
        if isinstance(value, list):
            return [self.env_value(v) for v in value]
        return self.originals.get(value, value) if isinstance(value, str) else value


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str
    params: tuple[Param, ...]


@dataclass(frozen=True)
class EnvInterface:
    kind: Literal["mcp", "action"]
    tools: tuple[ToolSpec, ...]
    # how sessions reach the server: `/ws` (OpenEnv's create_app), or MCP sessions over HTTP POST /mcp for a server
    # that serves no /ws (envs.generic.http_only, envs.core.http_mcp)
    transport: Literal["websocket", "http-mcp"] = "websocket"

    def tool(self, name: str) -> ToolSpec:
        return next(t for t in self.tools if t.name == name)


# ------------------------------------------------------------------------------------ docstrings
def split_docstring(text: str) -> tuple[str, dict[str, str]]:
    """(summary, {name: description}) from a Google-style docstring: the text before the first section
    header, and the entries of an Args/Attributes/Parameters section (deeper-indented lines continue one)."""
    summary: list[str] = []
    entries: dict[str, str] = {}
    section = current = entry_indent = None
    for raw in str(text or "")[:20 * MAX_DESCRIPTION_CHARS].splitlines():
        line, indent = raw.strip(), len(raw) - len(raw.lstrip())
        if line.endswith(":") and line[:-1].strip().lower() in SECTION_HEADERS:
            section, current, entry_indent = line[:-1].strip().lower(), None, None
            continue
        if section is None:
            summary.append(line)
        elif section in ARG_SECTIONS and line:
            m = ENTRY.match(line)
            if m and (entry_indent is None or indent <= entry_indent):
                entry_indent = indent if entry_indent is None else entry_indent
                current = m.group(1)
                entries[current] = m.group(2)
            elif current:
                entries[current] = f"{entries[current]} {line}"
    return one_line(" ".join(summary)), {k: one_line(v) for k, v in entries.items()}


# `name (type): text`. Possessive quantifiers: `a` + 100,000 spaces + `b` fails in linear time (it was quadratic).
ENTRY = re.compile(r"^(\w++)\s*+(?:\([^)]*+\))?\s*+:\s*+(.*)$")


# What transformers' get_json_schema (TRL's tool renderer) reads as structure inside a docstring: an argument's
# description ending in `(choices: [...])` becomes its enum, JSON-decoded (so `\u003c|im_start|>` and an escaped
# `\u200b` came back as the token and the invisible character), and `Returns:`/`Raises:` anywhere end the Args.
_DOCSTRING_MARKERS = re.compile(r"(?i)\b(choices|returns|raises|args):")


def one_line(text: str, limit: int = MAX_DESCRIPTION_CHARS) -> str:
    """Folded to one line, control characters escaped (a description can carry terminal escapes), chat-template tokens
    neutralised (it is written into every prompt), docstring markers broken (`choices :`), cut at `limit`."""
    line = untrusted.one_line(untrusted.neutralise_tokens(str(text)[: 4 * limit]), limit)
    return _DOCSTRING_MARKERS.sub(r"\1 :", line)


def shown_value(value: Any) -> Any:
    """An env's enum/const/example value as the model is shown it in a tool schema or a demo call: strings with
    chat-template tokens neutralised and control and format characters escaped (untrusted.safe_text), uncut."""
    return untrusted.safe_text(value) if isinstance(value, str) else value


# ------------------------------------------------------------------------------------ JSON schema -> hint
JSON_SCALARS = {"string": str, "integer": int, "number": float, "boolean": bool}


def resolve_refs(schema: Any, defs: dict) -> Any:
    """Inline `$ref: #/$defs/X` (pydantic puts nested models and enums there). A type that contains itself
    cannot become a tool argument, and inlining may multiply a schema's size: a $ref cycle, more than MAX_REF_LINKS
    links on one path, nesting past MAX_SCHEMA_DEPTH, or more than MAX_SCHEMA_NODES nodes once inlined raise
    UnsupportedSchema (one line) instead of a RecursionError or minutes and GBs. Iterative: no Python recursion."""
    budget = MAX_SCHEMA_NODES
    defs = defs if isinstance(defs, dict) else {}
    root: dict = {}
    stack: list[tuple[Any, tuple[str, ...], int, Any, Any]] = [(schema, (), 0, root, "schema")]
    while stack:
        node, path, depth, parent, key = stack.pop()
        budget -= 1
        if budget < 0:
            raise UnsupportedSchema(f"schema has more than {MAX_SCHEMA_NODES} nodes once its $refs are inlined")
        if depth > MAX_SCHEMA_DEPTH:
            raise UnsupportedSchema(f"schema nests deeper than {MAX_SCHEMA_DEPTH} levels once its $refs are inlined")
        while isinstance(node, dict) and "$ref" in node:
            name = str(node["$ref"]).rsplit("/", 1)[-1]
            if name in path:
                raise UnsupportedSchema(f"$ref cycle {' -> '.join((*path, name))[:300]}: a type that contains itself "
                                        "is not expressible as a TRL tool argument")
            if len(path) >= MAX_REF_LINKS:
                raise UnsupportedSchema(f"schema follows more than {MAX_REF_LINKS} $ref links on one path")
            target = defs.get(name, {})
            node = {**(target if isinstance(target, dict) else {}), **{k: v for k, v in node.items() if k != "$ref"}}
            path = (*path, name)
        if isinstance(node, dict):
            out: Any = {k: None for k in node if k != "$defs"}
            stack.extend((v, path, depth + 1, out, k) for k, v in node.items() if k != "$defs")
        elif isinstance(node, list):
            out = [None] * len(node)
            stack.extend((v, path, depth + 1, out, i) for i, v in enumerate(node))
        else:
            out = node
        parent[key] = out
    return root["schema"]


def shown_literal(values: list, where: str, originals: dict) -> Any:
    """Literal[values as the model is shown them] (#63: raw, `<|im_start|>system` in an enum forged a turn with Qwen3's
    template and U+200B passed), recording in `originals` the env's own value of each one shown otherwise."""
    seen: dict[str, str] = {}
    for value in values:
        if isinstance(value, str) and seen.setdefault(shown_value(value), value) != value:
            raise UnsupportedSchema(f"{where}: enum values {one_line(repr(seen[shown_value(value)]), 80)} and "
                                    f"{one_line(repr(value), 80)} differ only in characters the model is not shown "
                                    "as such (control, format or chat-template ones)")
    originals.update({shown: value for shown, value in seen.items() if shown != value})
    return Literal[tuple(shown_value(v) for v in values)]  # type: ignore[misc]


def type_hint(schema: dict, where: str, originals: dict | None = None) -> Any:
    """The Python type hint whose get_json_schema rendering is `schema` (types, items, enums, null); enum and const
    strings as the model is shown them (shown_literal; the env's own values recorded in `originals`)."""
    originals = {} if originals is None else originals
    if not isinstance(schema, dict):
        raise UnsupportedSchema(f"{where}: schema {schema!r} is not an object")
    if "enum" in schema:
        values = schema["enum"]
        if not values or not isinstance(values, list) or \
                not all(isinstance(v, (str, int, float, bool)) for v in values):
            raise UnsupportedSchema(f"{where}: enum {one_line(repr(values), 200)} mixes in values a tool schema "
                                    "cannot list")
        return shown_literal(values, where, originals)
    if "const" in schema and isinstance(schema["const"], (str, int, float, bool)):
        return shown_literal([schema["const"]], where, originals)
    for key in ("anyOf", "oneOf"):
        if key in schema:
            options = [o for o in schema[key] if o.get("type") != "null"]
            nullable = len(options) < len(schema[key])
            if len(options) != 1:
                raise UnsupportedSchema(f"{where}: {key} of {len(options)} types is not expressible as a TRL tool "
                                        "argument (one type, optionally null)")
            hint = type_hint(options[0], where, originals)
            return Optional[hint] if nullable else hint
    kind = schema.get("type")
    if isinstance(kind, list):
        kinds = [k for k in kind if k != "null"]
        if not kinds or not all(k in JSON_SCALARS for k in kinds):
            raise UnsupportedSchema(f"{where}: type {kind!r} is not expressible as a TRL tool argument")
        hint = Union[tuple(JSON_SCALARS[k] for k in kinds)]  # type: ignore[misc]
        return Optional[hint] if "null" in kind else hint
    if kind in JSON_SCALARS:
        return JSON_SCALARS[kind]
    if kind == "array":
        items = schema.get("items")
        return list[type_hint(items, f"{where}[]", originals)] if isinstance(items, dict) and items else list
    if kind == "object":
        return dict
    raise UnsupportedSchema(f"{where}: no JSON type ({one_line(str(schema))[:80]}); TRL tools need string, integer, "
                            "number, boolean, array, object or an enum")


def type_word(schema: dict) -> str:
    """`integer`, `string or null`, `one of 'a', 'b'`, ...: a field's type, for a description."""
    if "enum" in schema:
        return "one of " + ", ".join(repr(v) for v in schema["enum"])
    options = schema.get("anyOf") or schema.get("oneOf")
    if options:
        return " or ".join(type_word(o) for o in options)
    kind = schema.get("type", "value")
    return " or ".join(kind) if isinstance(kind, list) else str(kind)


def params_from_schema(schema: dict, where: str, doc_fields: dict[str, str],
                       skip: tuple[str, ...] = ()) -> tuple[Param, ...]:
    if not isinstance(schema or {}, dict):
        raise UnsupportedSchema(f"{where}: its schema is not a JSON object")
    props = (schema or {}).get("properties")
    fields = [k for k in props if k not in skip] if isinstance(props, dict) else []
    if len(fields) > MAX_TOOL_PARAMS:  # before inlining: it names the real problem
        raise UnsupportedSchema(f"{where}: {len(fields):,} fields, more than the {MAX_TOOL_PARAMS} a tool can take "
                                "(each is written into every prompt); write a tool class for this env (envs/README.md)")
    schema = resolve_refs(schema or {}, (schema or {}).get("$defs", {}))
    properties = schema.get("properties") or {}
    if not isinstance(properties, dict):
        raise UnsupportedSchema(f"{where}: `properties` is not a JSON object")
    required = set(r for r in (schema.get("required") or ()) if isinstance(r, str))
    params = []
    for name, prop in properties.items():
        if name in skip:
            continue
        check_identifier(name, f"{where} field")
        originals: dict[str, str] = {}
        try:
            hint = type_hint(prop, f"{where} field {name!r}", originals)
            description = one_line(prop.get("description") or doc_fields.get(name)
                                   or f"{prop.get('title') or name} ({type_word(prop)})")
        except UnsupportedSchema:
            raise
        except (AttributeError, TypeError, KeyError, ValueError) as exc:  # a malformed schema: one line, not a trace
            raise UnsupportedSchema(f"{where} field {name!r}: malformed schema ({type(exc).__name__})") from None
        params.append(Param(name, hint, description, name in required, prop, originals))
    return tuple(params)


def check_identifier(name: Any, what: str) -> None:
    """A name that becomes a Python parameter or method: an ASCII identifier of at most MAX_NAME_CHARS, not a keyword,
    not `self`, no `_` start. ASCII: `rеset` (Cyrillic е) or fullwidth `ｓｅｌｆ` would pass a check against the reserved
    names, and Python folds fullwidth names (NFKC) when it compiles a signature."""
    if not isinstance(name, str) or not name.isascii() or not name.isidentifier() or len(name) > MAX_NAME_CHARS \
            or keyword.iskeyword(name) or name == "self" or name.startswith("_"):
        shown = ascii(name) if len(ascii(name)) <= 80 else ascii(name)[:79] + "…"  # a homoglyph shows as \u0435
        raise UnsupportedSchema(f"{what} {shown}: not usable as a Python name (an ASCII identifier of at most "
                                f"{MAX_NAME_CHARS} characters that is not a keyword, `self` or private), so TRL cannot "
                                "pass it")


# ------------------------------------------------------------------------------------ discovery
def get_schema(base_url: str) -> dict:
    """GET /schema in bounded time and size (envs.core.probe): the server may be an image nobody here wrote."""
    from envs.core import probe

    url = f"{base_url.rstrip('/')}/schema"
    try:
        status, body = probe.get_json(url, probe.SCHEMA_DEADLINE_S, probe.MAX_SCHEMA_BYTES)
    except probe.ProbeError as exc:
        raise InterfaceError(str(exc)) from None
    if status != 200 or not isinstance(body, dict) or not isinstance(body.get("action"), dict):
        shown = untrusted.strip_credentials(url)
        raise NoActionSchema(f"{shown} answered {status} without an action schema: not an OpenEnv server "
                             "(OpenEnv's create_app serves /schema and /ws)")
    return body


def is_mcp(action_schema: dict) -> bool:
    props = action_schema.get("properties") or {}
    return "tool_name" in props and "arguments" in props


def discover(base_url: str, timeout_s: float = 10.0) -> EnvInterface:
    try:
        schema = get_schema(base_url)
    except NoActionSchema:
        from envs.generic import http_only

        found = http_only.survey(base_url)  # an OpenEnv server serving only HTTP?
        if found.trainable:
            return EnvInterface("mcp", tuple(mcp_tools(list(found.tools))), transport="http-mcp")
        why = http_only.refusal(base_url, found)  # why it cannot be trained, and the fix
        if why is None:
            raise
        raise InterfaceError(why) from None
    action = schema["action"]
    if is_mcp(action):
        return EnvInterface("mcp", tuple(mcp_tools(list_tools(base_url, timeout_s))))
    return EnvInterface("action", (action_tool(action),))


def list_tools(base_url: str, timeout_s: float) -> list[dict]:
    from websockets.exceptions import ConnectionClosed

    from envs.core.client import EnvServerError, SessionClient

    client = SessionClient(base_url, connect_timeout_s=timeout_s, message_timeout_s=timeout_s,
                           capacity_wait_s=timeout_s, reconnect_wait_s=0, ping_interval_s=None)
    try:
        client.reset()  # opens the session; list_tools needs no reset, but some envs only answer after one
        reply = client.step({"type": "list_tools"})
    except (EnvServerError, ConnectionError, ConnectionClosed, OSError, untrusted.UntrustedReply) as exc:
        raise InterfaceError(f"{untrusted.strip_credentials(base_url)}: listing its MCP tools failed: {exc}") from None
    finally:
        client.close()
    tools = (reply.get("observation") or {}).get("tools")
    if not isinstance(tools, list):
        raise InterfaceError(f"{untrusted.strip_credentials(base_url)}: a list_tools step answered without a tool "
                             f"list: {one_line(reply, 200)}")
    return tools


def mcp_tools(payloads: list[dict]) -> list[ToolSpec]:
    if not payloads:
        raise UnsupportedSchema("the MCP env lists no tools: nothing for the model to call")
    if len(payloads) > MAX_TOOLS:
        raise UnsupportedSchema(f"the MCP env lists {len(payloads):,} tools, more than the {MAX_TOOLS} a prompt can "
                                "carry (each one's schema is in every prompt); write a tool class for this env (envs/README.md)")
    specs, seen = [], set()
    for payload in payloads:
        if not isinstance(payload, dict):
            raise UnsupportedSchema(f"the MCP tool list holds {type(payload).__name__}, not tool objects")
        name = payload.get("name", "")
        check_identifier(name, "tool")  # repr() in the message: a newline or escape code is shown, not printed
        where = f"tool {name!r}"
        if name in RESERVED_TOOL_NAMES:
            raise UnsupportedSchema(f"{where}: a TRL tool cannot be named {name!r} (reserved for the env class)")
        if name in seen:
            raise UnsupportedSchema(f"{where}: listed twice; a TRL tool name must be unique")
        seen.add(name)
        summary, doc_fields = split_docstring(payload.get("description") or "")
        schema = payload.get("input_schema") or payload.get("inputSchema") or {}
        params = params_from_schema(schema, where, doc_fields)
        specs.append(ToolSpec(name, summary or f"The {name} tool.", params))
    return specs


# A word of a class name: an acronym before a capitalised word (the `DM` of DMControl), a capitalised or lowercase
# word with its digits (Connect4), an acronym at the end or alone (REPL, V2), digits.
_NAME_WORD = re.compile(r"(?P<acronym>[A-Z]+(?=[A-Z][a-z]))|[A-Z]?[a-z]+[0-9]*|[A-Z]+[0-9]*|[0-9]+")


def snake_words(name: str) -> list[str]:
    """`DMControlAction` -> dm, control, action; `REPLAction` -> repl, action. An acronym glued to a short
    capitalised word before it is part of that name (`FinRL`, `FinQA`: finrl, finqa), not a word of its own."""
    words: list[str] = []
    for chunk in re.split(r"[^A-Za-z0-9]+", name):
        previous = None
        for match in _NAME_WORD.finditer(chunk):
            word = match.group()
            glued = (match.group("acronym") and previous is not None and previous.end() == match.start()
                     and previous.group()[:1].isupper() and previous.group()[1:].islower() and len(previous.group()) <= 3)
            if glued:
                words[-1] += word.lower()
            else:
                words.append(word.lower())
            previous = match
    return words


def action_tool_name(title: str) -> str:
    """The action's class name in snake case (`REPLAction` -> `repl_action`, `DMControlAction` -> `dm_control_action`);
    a title that would be a reserved or keyword name gets `_action`."""
    snake = "_".join(snake_words(str(title or "Action")[:100])) or "action"
    snake = snake if snake[0].isalpha() else f"act_{snake}"
    return f"{snake}_action" if snake in RESERVED_TOOL_NAMES or keyword.iskeyword(snake) or snake == "self" else snake


def action_tool(action: dict) -> ToolSpec:
    title = action.get("title") or "Action"
    name = action_tool_name(title)
    summary, doc_fields = split_docstring(action.get("description") or "")
    params = params_from_schema(action, f"action {title}", doc_fields, skip=FRAMEWORK_ACTION_FIELDS)
    if not params:
        raise UnsupportedSchema(f"action {title}: no fields besides {', '.join(FRAMEWORK_ACTION_FIELDS)}, so the "
                                "model has nothing to choose; write a tool class for this env (envs/README.md)")
    description = (summary.rstrip(".") + ". " if summary else "") + \
        "Each call is one step of the episode; the result shows the new observation."
    return ToolSpec(name, description, params)
