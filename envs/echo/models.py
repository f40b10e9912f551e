"""Echo wire schema: exactly upstream OpenEnv echo_env's (it is an MCP env).

Actions are openenv's `CallToolAction` / `ListToolsAction`; observations `CallToolObservation` /
`ListToolsObservation`. A tool result has the shape FastMCP's `CallToolResult` serializes to on the
wire (captured from the stock server), so `MCPToolClient.call_tool` returns the same value from both.
"""

from __future__ import annotations

import json
from typing import Any

from openenv.core.env_server.mcp_types import (  # noqa: F401  (re-exported schema)
    CallToolAction,
    CallToolObservation,
    ListToolsAction,
    ListToolsObservation,
    Tool,
    ToolError,
    ToolErrorType,
)
from openenv.core.env_server.types import State  # noqa: F401

_MESSAGE_SCHEMA = {
    "additionalProperties": False,
    "properties": {"message": {"type": "string", "description": "The message to echo back"}},
    "required": ["message"],
    "type": "object",
}

TOOLS = (
    Tool(name="echo_message", description="Echo back the provided message.", input_schema=_MESSAGE_SCHEMA),
    Tool(
        name="echo_with_length",
        description="Echo back the message with its length.",
        input_schema=_MESSAGE_SCHEMA,
    ),
)
TOOL_NAMES = tuple(t.name for t in TOOLS)
# What upstream's FastMCP makes of each tool's return type (str is wrapped in {"result": ...}).
_OUTPUT_SCHEMAS = {
    "echo_message": {"properties": {"result": {"type": "string"}}, "required": ["result"], "type": "object",
                     "x-fastmcp-wrap-result": True},
    "echo_with_length": {"additionalProperties": True, "type": "object"},
}


def mcp_tool_list() -> list[dict]:
    """The `/mcp` tools/list items, as upstream's (MCP `Tool.model_dump()` from FastMCP)."""
    return [
        {"name": t.name, "title": None, "description": t.description, "inputSchema": json.loads(json.dumps(t.input_schema)),
         "outputSchema": json.loads(json.dumps(_OUTPUT_SCHEMAS[t.name])), "icons": None, "annotations": None,
         "meta": {"fastmcp": {"tags": []}}, "execution": None}
        for t in TOOLS
    ]


def tool_result(value: Any) -> dict:
    """What upstream's FastMCP `CallToolResult` for `value` serializes to."""
    if isinstance(value, str):
        return {
            "content": [{"type": "text", "text": value, "annotations": None, "meta": None}],
            "structured_content": {"result": value},
            "meta": {"fastmcp": {"wrap_result": True}},
            "data": value,
            "is_error": False,
        }
    return {
        "content": [
            {"type": "text", "text": json.dumps(value, separators=(",", ":")), "annotations": None, "meta": None}
        ],
        "structured_content": value,
        "meta": None,
        "data": value,
        "is_error": False,
    }
