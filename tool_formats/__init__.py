"""Tool-call formats: how a model writes a call to a tool inside its turn, one entry per format.

Shared by the environments (envs/tool_calls.py reads a turn as an Action) and the rollout
engine's OpenAI API (rl/engine/openai_api.py returns a reply's calls as `tool_calls`). It
imports nothing of the project, so both may import it under tests/test_layout.py's rules
(envs/ imports nothing of glmjax/ or rl/; rl/engine/ nothing of envs/).

    "glm"   GLM-4.5 / GLM-5's XML, every argument value a string:
                <tool_call>get_weather
                <arg_key>city</arg_key>
                <arg_value>Paris</arg_value>
                </tool_call>
    "json"  Hermes / Qwen style, one JSON object per call:
                <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>

    content, calls = extract_tool_calls(text, "glm")   # the text without the calls, [ToolCall]
    style = style_of(tokenizer.chat_template)          # the format a chat template writes

A format is an entry of FORMATS: the parser of one block's body (between <tool_call> and
</tool_call>) and how its error messages show a call and an argument. A block its parser
refuses stays in the content and is named in `scan(...).errors`, as is a <tool_call> that
is never closed, so nothing the model wrote is dropped silently.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict


class Format(NamedTuple):
    """parse(body, properties) -> ToolCall, ValueError when the body is not a call of this
    format; `properties`: the tools' JSON-schema properties by tool name (may be empty).
    `call` and `argument` show how the format writes a call's name and an argument, for
    error messages (str.format with name= / key=)."""

    parse: Callable[[str, Mapping[str, dict]], ToolCall]
    call: str
    argument: str


_GLM_NAME = re.compile(r"\s*([A-Za-z_][\w.-]*)")
_GLM_ARG = re.compile(r"<arg_key>\s*(.*?)\s*</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


def _glm(body: str, properties: Mapping[str, dict]) -> ToolCall:
    """GLM writes every value as text; a value whose tool schema declares another type
    (integer, object, ...) is read back as JSON when it parses, as the template wrote it
    with `tojson`."""
    name = _GLM_NAME.match(body)
    if name is None:
        raise ValueError(f"no tool name after <tool_call> (found {body[:40]!r})")
    schema = properties.get(name.group(1), {})
    arguments = {}
    for key, value in _GLM_ARG.findall(body[name.end():]):
        if schema.get(key, {}).get("type", "string") != "string":
            try:
                value = json.loads(value)
            except ValueError:
                pass
        arguments[key] = value
    return ToolCall(name.group(1), arguments)


def _json(body: str, properties: Mapping[str, dict]) -> ToolCall:
    """{"name": str, "arguments": object}; `arguments` may also be that object as a JSON
    string (as OpenAI's API writes it) or absent (no arguments)."""
    try:
        call = json.loads(body)
    except ValueError as err:
        raise ValueError(f"not JSON ({err})") from None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        raise ValueError(f'expected {{"name": ..., "arguments": {{...}}}}, found {body.strip()[:60]!r}')
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError as err:
            raise ValueError(f'"arguments" is a string that is not JSON ({err})') from None
    if not isinstance(arguments, dict):
        raise ValueError(f'"arguments" must be an object, found {type(arguments).__name__}')
    return ToolCall(call["name"], arguments)


FORMATS: dict[str, Format] = {
    "glm": Format(_glm, "<tool_call>{name}", "<arg_key>{key}</arg_key>"),
    "json": Format(_json, '<tool_call>{{"name": "{name}", ...}}', '"arguments": {{"{key}": ...}}'),
}


def format_of(style: str) -> Format:
    if style not in FORMATS:
        raise ValueError(f"tool-call format {style!r} is unknown: expected one of {sorted(FORMATS)}")
    return FORMATS[style]


class Scan(NamedTuple):
    content: str  # the text with every parsed call removed (refused blocks stay)
    calls: list[ToolCall]
    errors: list[str]  # one line per refused block, and an unclosed <tool_call>


def properties_of(tools: Sequence[dict] | None) -> dict[str, dict]:
    """Tool name -> its parameters' JSON-schema properties, from OpenAI-style tools
    ({"type": "function", "function": {...}}) or bare function schemas."""
    out = {}
    for tool in tools or ():
        f = tool.get("function", tool) if isinstance(tool, dict) else {}
        if isinstance(f, dict) and isinstance(f.get("name"), str):
            params = f.get("parameters")
            out[f["name"]] = (params.get("properties") or {}) if isinstance(params, dict) else {}
    return out


def scan(text: str, style: str, tools: Sequence[dict] | None = None) -> Scan:
    """Every <tool_call> block of `text` read in `style` (module docstring). `tools`: the
    tool schemas, which type GLM's string values."""
    parse, properties = format_of(style).parse, properties_of(tools)
    calls, errors, kept = [], [], []
    last = 0
    for block in _BLOCK.finditer(text):
        try:
            call = parse(block.group(1), properties)
        except ValueError as err:
            errors.append(f"tool call {len(calls) + len(errors) + 1}: {err}")
            continue
        calls.append(call)
        kept.append(text[last:block.start()])
        last = block.end()
    content = "".join(kept) + text[last:]
    if OPEN in _BLOCK.sub("", content):
        errors.append(f"unclosed {OPEN}")
    return Scan(content, calls, errors)


def extract_tool_calls(text: str, style: str, tools: Sequence[dict] | None = None) -> tuple[str, list[ToolCall]]:
    """(the text without its tool calls, the calls) in `style`; see `scan` for what a
    malformed call leaves."""
    found = scan(text, style, tools)
    return found.content, found.calls


def style_of(chat_template: str | None) -> str:
    """The format a chat template writes tool calls in: "glm" when it writes <arg_key>,
    "json" when it writes <tool_call> otherwise. ValueError for a template that writes
    neither (its model's calls have no format of this table)."""
    if chat_template and "<arg_key>" in chat_template:
        return "glm"
    if chat_template and OPEN in chat_template:
        return "json"
    raise ValueError(f"the chat template writes no {OPEN}: its tool-call format is none of {sorted(FORMATS)}")
