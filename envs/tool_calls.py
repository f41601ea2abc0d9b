"""Action formats: how a model's turn is read as commands and a submit.

One parser per format (``PARSERS``, chosen by name in a config):

- ``"bash"``: ``<bash>ls</bash>`` blocks and ``<submit/>`` (``envs.base.parse_action``).
- ``"glm"``: GLM-4.5 / GLM-5's own tool calls, XML inside the assistant turn, one
  ``<arg_key>``/``<arg_value>`` pair per argument; the results come back in an
  observation turn:

      <tool_call>bash
      <arg_key>command</arg_key>
      <arg_value>ls -la /app</arg_value>
      </tool_call>
      <tool_call>submit
      <arg_key>answer</arg_key>
      <arg_value>42</arg_value>
      </tool_call>

- ``"json"``: the same tools called in the Hermes / Qwen JSON format, for models whose
  chat template writes it:

      <tool_call>{"name": "bash", "arguments": {"command": "ls -la /app"}}</tool_call>

  Tools: ``bash`` (argument ``command``) and ``submit`` (optional ``answer``). A call to
  another tool, or without its argument, runs nothing and the observation says which.

The tool-call formats themselves (``extract_tool_calls``, ``style_of``, ``ToolCall``) are
the table in ``tool_formats``, which the rollout engine's OpenAI API reads too; this module
turns their calls into an ``Action``.
"""

from __future__ import annotations

from collections.abc import Callable

from envs.base import Action, parse_action
from tool_formats import FORMATS, ToolCall, extract_tool_calls, scan, style_of

__all__ = ["PARSERS", "TOOLS", "ToolCall", "extract_tool_calls", "parse_json_tool_call", "parse_tool_call",
           "parser", "style_of"]

TOOLS = {"bash": ("command",), "submit": ()}


def _action(text: str, style: str) -> Action:
    """Commands and submit from the tool calls of `text` in `style` (module docstring)."""
    fmt, found = FORMATS[style], scan(text, style)
    commands, submit, answer, errors = [], False, None, list(found.errors)
    for call in found.calls:
        if call.name not in TOOLS:
            errors.append(f"unknown tool {call.name!r} (tools: {', '.join(TOOLS)})")
            continue
        missing = [k for k in TOOLS[call.name] if k not in call.arguments]
        if missing:
            errors.append(f"tool {call.name!r} needs {fmt.argument.format(key=missing[0])}")
            continue
        if call.name == "bash":
            command = call.arguments["command"]
            command = command if isinstance(command, str) else str(command)
            if command.strip():
                commands.append(command.strip("\n"))
        else:
            value = call.arguments.get("answer", answer)
            submit, answer = True, value if value is None or isinstance(value, str) else str(value)
    if errors:
        return Action(tuple(commands), submit, answer, False, "; ".join(errors))
    if not commands and not submit:
        return Action((), False, None, False,
                      f"no {fmt.call.format(name='bash')} or {fmt.call.format(name='submit')}")
    return Action(tuple(commands), submit, answer, True)


def parse_tool_call(text: str) -> Action:
    """Commands and submit from GLM tool calls (module docstring)."""
    return _action(text, "glm")


def parse_json_tool_call(text: str) -> Action:
    """Commands and submit from JSON tool calls (module docstring)."""
    return _action(text, "json")


PARSERS: dict[str, Callable[[str], Action]] = {"bash": parse_action, "glm": parse_tool_call,
                                               "json": parse_json_tool_call}


def parser(name: str) -> Callable[[str], Action]:
    if name not in PARSERS:
        raise ValueError(f"action format {name!r} is unknown: expected one of {sorted(PARSERS)}")
    return PARSERS[name]
