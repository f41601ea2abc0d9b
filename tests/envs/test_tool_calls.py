"""envs/tool_calls.py and the format table it reads (tool_formats): GLM's XML and the
Hermes / Qwen JSON tool calls, extracted, detected from a chat template, and read as Actions."""

import pytest

from envs import tool_calls
from envs.tool_calls import PARSERS, ToolCall, extract_tool_calls, parser, style_of
from glmjax.tiny_checkpoint import GLM_STYLE_TEMPLATE
from tool_formats import FORMATS, scan

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}, "note": {"type": "string"},
                                     "opts": {"type": "object"}}}}}]

GLM = ("Adding.<tool_call>add\n<arg_key>a</arg_key>\n<arg_value>2</arg_value>\n<arg_key>b</arg_key>\n"
       "<arg_value>40</arg_value>\n<arg_key>note</arg_key>\n<arg_value>7</arg_value>\n<arg_key>opts</arg_key>\n"
       '<arg_value>{"x": [1]}</arg_value>\n</tool_call> Done.<tool_call>submit\n</tool_call>')
JSON = ('Adding.<tool_call>{"name": "add", "arguments": {"a": 2, "b": 40, "note": "7", "opts": {"x": [1]}}}'
        '</tool_call> Done.<tool_call>{"name": "submit", "arguments": "{}"}</tool_call>')


@pytest.mark.parametrize("style, text", [("glm", GLM), ("json", JSON)])
def test_both_formats_give_the_same_calls_and_content(style, text):
    """GLM's string values are typed by the tools' schemas (integer, object; a string stays a
    string), JSON's come typed; either way the markup leaves the content."""
    content, calls = extract_tool_calls(text, style, TOOLS)
    assert content == "Adding. Done."
    assert calls == [ToolCall("add", {"a": 2, "b": 40, "note": "7", "opts": {"x": [1]}}), ToolCall("submit", {})]


def test_without_schemas_glm_values_stay_strings():
    _, calls = extract_tool_calls(GLM, "glm")
    assert calls[0].arguments == {"a": "2", "b": "40", "note": "7", "opts": '{"x": [1]}'}


@pytest.mark.parametrize("style, text, error", [
    ("json", "<tool_call>{'name': 'add'}</tool_call>", "tool call 1: not JSON"),
    ("json", '<tool_call>{"arguments": {}}</tool_call>', 'tool call 1: expected {"name": ..., "arguments": {...}}'),
    ("json", '<tool_call>{"name": "add", "arguments": [1]}</tool_call>',
     'tool call 1: "arguments" must be an object, found list'),
    ("glm", "<tool_call>\n<arg_key>a</arg_key></tool_call>", "tool call 1: no tool name after <tool_call>"),
    ("glm", "ok <tool_call>add\n<arg_key>a</arg_key>", "unclosed <tool_call>"),
])
def test_a_malformed_call_stays_in_the_content_and_is_named(style, text, error):
    found = scan(text, style)
    assert found.calls == [] and found.content == text
    assert any(e.startswith(error) for e in found.errors), found.errors


def test_style_of_a_chat_template():
    assert style_of(GLM_STYLE_TEMPLATE) == "glm"
    assert style_of("{% for m in messages %}<tool_call>{{ m.tool_calls | tojson }}</tool_call>{% endfor %}") == "json"
    with pytest.raises(ValueError, match="writes no <tool_call>"):
        style_of("{% for m in messages %}{{ m.content }}{% endfor %}")
    with pytest.raises(ValueError, match="unknown"):
        scan("", "xml")


@pytest.mark.parametrize("style, bash, submit", [
    ("glm", "<tool_call>bash\n<arg_key>command</arg_key>\n<arg_value>ls /app\n</arg_value>\n</tool_call>",
     "<tool_call>submit\n<arg_key>answer</arg_key>\n<arg_value>42</arg_value>\n</tool_call>"),
    ("json", '<tool_call>{"name": "bash", "arguments": {"command": "ls /app\\n"}}</tool_call>',
     '<tool_call>{"name": "submit", "arguments": {"answer": 42}}</tool_call>'),
])
def test_each_format_reads_as_the_same_action(style, bash, submit):
    action = parser(style)(f"First.{bash}\n{submit}")
    assert action.parsed and action.commands == ("ls /app",) and action.submit and action.answer == "42"


@pytest.mark.parametrize("style, text, error", [
    ("glm", "<tool_call>python\n<arg_key>code</arg_key>\n<arg_value>1</arg_value>\n</tool_call>",
     "unknown tool 'python' (tools: bash, submit)"),
    ("glm", "<tool_call>bash\n<arg_key>cmd</arg_key><arg_value>ls</arg_value></tool_call>",
     "tool 'bash' needs <arg_key>command</arg_key>"),
    ("json", '<tool_call>{"name": "bash", "arguments": {"cmd": "ls"}}</tool_call>',
     'tool \'bash\' needs "arguments": {"command": ...}'),
    ("glm", "I will look around.", "no <tool_call>bash or <tool_call>submit"),
    ("json", "I will look around.", 'no <tool_call>{"name": "bash", ...} or <tool_call>{"name": "submit", ...}'),
    ("json", "<tool_call>{bash}</tool_call>", "tool call 1: not JSON"),
])
def test_actions_name_what_is_wrong(style, text, error):
    action = PARSERS[style](text)
    assert not action.parsed and action.error.startswith(error), action.error


def test_the_table_is_one_entry_per_format():
    assert set(FORMATS) == {"glm", "json"} and set(PARSERS) == {"bash", "glm", "json"}
    assert tool_calls.parse_tool_call is PARSERS["glm"]
