"""One prompt's session: the sandbox, the agent loop, the tool calls, the record."""
