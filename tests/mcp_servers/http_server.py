"""A streamable HTTP MCP server (the SDK's FastMCP) with an in-memory counter, for the HTTP tests.

`python http_server.py PORT` serves http://127.0.0.1:PORT/mcp. Its state is in the server
process, so a client cannot copy it: an environment on it is not forkable.
"""
import sys

from mcp.server.fastmcp import FastMCP
from mcp.types import ToolAnnotations

server = FastMCP("counter", host="127.0.0.1", port=int(sys.argv[1]) if len(sys.argv) > 1 else 8000, log_level="WARNING")
COUNT = {"value": 0}


@server.tool(description="The counter's value.", annotations=ToolAnnotations(readOnlyHint=True))
def get_count() -> dict:
    return {"count": COUNT["value"]}


@server.tool(description="Add to the counter.", annotations=ToolAnnotations(readOnlyHint=False, destructiveHint=False))
def add(by: int) -> dict:
    COUNT["value"] += by
    return {"count": COUNT["value"]}


if __name__ == "__main__":
    server.run("streamable-http")
