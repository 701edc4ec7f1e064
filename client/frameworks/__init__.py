"""Agent frameworks as enforcement points: LangChain, LangGraph, the OpenAI Agents SDK.

Each integration is a module of its own, imported only when used, so
`import toolgate` never needs a framework:

- `toolgate.client.frameworks.langchain`: `GatewayToolkit`, `GatewayToolMiddleware`
  (`pip install 'toolgate[langchain]'`);
- `toolgate.client.frameworks.langgraph`: `GatewayToolNode`, `SQLiteCheckpointer`
  (`pip install 'toolgate[langgraph]'`);
- `toolgate.client.frameworks.openai_agents`: `gateway_function_tools`
  (`pip install 'toolgate[openai-agents]'`).

`core` (what the model reads for each status) and `session` (`GatewaySession`:
the agent's connection, end user and tool listing) need no framework;
`tool_messages` (LangChain `ToolMessage`s) needs langchain-core, `tool_calls`
(a model's tool call at the gateway, the approval interrupt) langgraph too.
"""
