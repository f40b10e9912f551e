"""A third-party env's /schema and tool list, learned by envs.generic: bounded work, and names that cannot break
the tool class. Each hostile input ends in one UnsupportedSchema line (what the preflight prints)."""

from __future__ import annotations

import pytest

from envs.generic.interface import (
    MAX_DESCRIPTION_CHARS,
    RESERVED_TOOL_NAMES,
    UnsupportedSchema,
    action_tool,
    mcp_tools,
    params_from_schema,
    split_docstring,
)
from envs.generic.tool import GenericTool, make_tool_class


def tool(name, properties=None, description="A tool."):
    return {"name": name, "description": description,
            "input_schema": {"type": "object", "properties": properties or {"x": {"type": "string"}}}}


def test_a_type_that_contains_itself_is_refused_at_once():
    # 612 bytes that took 52 s and 3.9 GB to inline: 16 properties, each a $ref to their own type.
    node = {"type": "object", "properties": {f"p{i}": {"$ref": "#/$defs/Node"} for i in range(16)}}
    schema = {"type": "object", "properties": {"root": {"$ref": "#/$defs/Node"}}, "$defs": {"Node": node}}
    with pytest.raises(UnsupportedSchema, match=r"\$ref cycle Node -> Node"):
        params_from_schema(schema, "action A", {})


def test_a_schema_that_multiplies_when_inlined_is_capped():
    defs = {f"L{d}": {"type": "object", "properties": {f"p{i}": {"$ref": f"#/$defs/L{d + 1}"} for i in range(16)}}
            for d in range(6)}
    defs["L6"] = {"type": "string"}
    schema = {"type": "object", "properties": {"root": {"$ref": "#/$defs/L0"}}, "$defs": defs}  # 16^6 leaves
    with pytest.raises(UnsupportedSchema, match="more than 20000 nodes"):
        params_from_schema(schema, "action A", {})


def test_docstrings_parse_in_linear_time_and_descriptions_are_capped():
    summary, fields = split_docstring("Args:\n    a" + " " * 100_000 + "b\n")  # 21 s with the old regex
    assert fields == {}
    summary, _ = split_docstring("x" * 50_000)
    assert len(summary) == MAX_DESCRIPTION_CHARS


@pytest.mark.parametrize("name", [*RESERVED_TOOL_NAMES, "_private", "self", "from", "bad\nname", "\x1b[31mred", "", 7])
def test_mcp_tool_names_that_would_break_the_class_are_refused_with_the_name_escaped(name):
    with pytest.raises(UnsupportedSchema) as err:
        mcp_tools([tool(name)])
    assert "\n" not in str(err.value) and "\x1b" not in str(err.value)


def test_duplicate_tools_and_keyword_fields_and_malformed_types_are_one_line():
    with pytest.raises(UnsupportedSchema, match="listed twice"):
        mcp_tools([tool("note"), tool("note")])
    with pytest.raises(UnsupportedSchema, match="field 'from': not usable as a Python name"):
        mcp_tools([tool("move", {"from": {"type": "string"}})])  # was a traceback from inspect.Parameter
    with pytest.raises(UnsupportedSchema, match="field 'x': malformed schema"):
        mcp_tools([tool("move", {"x": {"anyOf": [5, {"type": "string"}]}})])
    with pytest.raises(UnsupportedSchema, match="not a JSON object"):
        mcp_tools([{"name": "move", "input_schema": {"properties": ["x"]}}])


def test_an_action_titled_reset_keeps_the_classes_own_reset():
    spec = action_tool({"title": "Reset", "type": "object", "properties": {"number": {"type": "integer"}}})
    assert spec.name == "reset_action"
    from envs.generic.interface import EnvInterface

    cls = make_tool_class("guess", EnvInterface("action", (spec,)))
    assert cls.reset is GenericTool.reset and callable(cls.reset_action)


def test_every_name_the_bound_class_owns_is_reserved():
    """A new attribute of GenericTool or of trainer.rollouts.envs_binding's bound class must be reserved too."""
    from envs.generic.interface import EnvInterface, ToolSpec
    from trainer.rollouts.envs_binding import bind, tool_method_names

    cls = make_tool_class("probe", EnvInterface("mcp", (ToolSpec("note", "Note.", ()),)))
    bound = bind("probe", cls, "http://127.0.0.1:9")
    owned = {n for n in dir(bound) if not n.startswith("_")} - set(tool_method_names(cls))
    assert owned <= set(RESERVED_TOOL_NAMES), owned - set(RESERVED_TOOL_NAMES)
