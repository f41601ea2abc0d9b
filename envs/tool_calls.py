"""Action formats: how a model's turn is read as commands and a submit.

Two formats, one parser each (``PARSERS``, chosen by name in a config):

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

  Tools: ``bash`` (argument ``command``) and ``submit`` (optional ``answer``). A call to
  another tool, or without its argument, runs nothing and the observation says which.
"""

from __future__ import annotations

import re
from typing import Callable

from envs.base import Action, parse_action

_CALL = re.compile(r"<tool_call>\s*([A-Za-z_][\w.-]*)\s*(.*?)</tool_call>", re.DOTALL)
_ARG = re.compile(r"<arg_key>\s*(.*?)\s*</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)
TOOLS = {"bash": ("command",), "submit": ()}


def parse_tool_call(text: str) -> Action:
    """Commands and submit from GLM tool calls (module docstring)."""
    commands, submit, answer, errors = [], False, None, []
    for call in _CALL.finditer(text):
        name, args = call.group(1), dict(_ARG.findall(call.group(2)))
        if name not in TOOLS:
            errors.append(f"unknown tool {name!r} (tools: {', '.join(TOOLS)})")
            continue
        missing = [k for k in TOOLS[name] if k not in args]
        if missing:
            errors.append(f"tool {name!r} needs <arg_key>{missing[0]}</arg_key>")
            continue
        if name == "bash":
            if args["command"].strip():
                commands.append(args["command"].strip("\n"))
        else:
            submit, answer = True, args.get("answer", answer)
    rest = _CALL.sub("", text)
    if "<tool_call>" in rest:
        errors.append("unclosed <tool_call>")
    if errors:
        return Action(tuple(commands), submit, answer, False, "; ".join(errors))
    if not commands and not submit:
        return Action((), False, None, False, "no <tool_call>bash or <tool_call>submit")
    return Action(tuple(commands), submit, answer, True)


PARSERS: dict[str, Callable[[str], Action]] = {"bash": parse_action, "glm": parse_tool_call}


def parser(name: str) -> Callable[[str], Action]:
    if name not in PARSERS:
        raise ValueError(f"action format {name!r} is unknown: expected one of {sorted(PARSERS)}")
    return PARSERS[name]
