"""A small terminus-style agent: a chat loop whose only actions are tool calls into the
task's shell, written against the OpenAI chat API and nothing else.

    run = terminus(openai.OpenAI(base_url=..., api_key=...), "my-model", instruction, shell)

Each turn sends the whole conversation with the tools ``bash(command)`` and
``submit(answer)``; each tool call runs in the shell and its output goes back as a ``tool``
message with the call's id. A reply without a tool call gets a user message asking for
one. The loop ends at ``submit``, when the shell says the episode is over (its turn or time
budget), after ``max_turns`` model turns, or when the server refuses the next call (the
conversation outgrew the model's context): ``AgentRun.stopped`` says which.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Protocol

SHELL_TOOLS = (
    {"type": "function", "function": {"name": "bash", "description": "Run a shell command in the task's sandbox.",
                                      "parameters": {"type": "object", "required": ["command"],
                                                     "properties": {"command": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "submit", "description": "Finish; the tests run on the sandbox.",
                                      "parameters": {"type": "object",
                                                     "properties": {"answer": {"type": "string"}}}}},
)
NUDGE = "Call a tool: bash to run a command, submit when the task is done."


class Shell(Protocol):
    """The environment as an agent sees it."""

    done: bool  # the episode is over (submitted, or out of turns or time)

    def bash(self, command: str) -> str: ...

    def submit(self, answer: str | None) -> str: ...


@dataclasses.dataclass
class AgentRun:
    turns: int = 0  # model replies
    tool_calls: int = 0
    stopped: str = ""  # "submit" | "env_done" | "max_turns" | "refused"
    error: str | None = None  # the server's message when it refused a call
    messages: list = dataclasses.field(default_factory=list)


def terminus(client, model: str, instruction: str, shell: Shell, *, max_turns: int = 8, max_tokens: int = 128,
             temperature: float = 1.0, seed: int | None = None, system: str | None = None) -> AgentRun:
    """Runs the episode (module docstring); the shell holds its outcome."""
    import openai

    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": instruction}]
    run = AgentRun(messages=messages)
    while run.turns < max_turns and not shell.done:
        try:
            reply = client.chat.completions.create(model=model, messages=messages, tools=list(SHELL_TOOLS),
                                                   max_tokens=max_tokens, temperature=temperature, seed=seed)
        except openai.BadRequestError as err:
            run.stopped, run.error = "refused", str(err)
            return run
        run.turns += 1
        message = reply.choices[0].message
        calls = message.tool_calls or []
        messages.append({"role": "assistant", "content": message.content or "",
                         **({"tool_calls": [c.model_dump() for c in calls]} if calls else {})})
        if not calls:
            messages.append({"role": "user", "content": NUDGE})
            continue
        for call in calls:
            run.tool_calls += 1
            output = _call(shell, call.function.name, call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": output})
            if shell.done:
                run.stopped = "submit" if call.function.name == "submit" else "env_done"
                return run
    run.stopped = "env_done" if shell.done else "max_turns"
    return run


def _call(shell: Shell, name: str, arguments: str) -> str:
    try:
        args = json.loads(arguments or "{}")
    except ValueError:
        return f"[arguments are not JSON: {arguments[:80]!r}]"
    if not isinstance(args, dict):
        return "[arguments must be a JSON object]"
    if name == "bash":
        command = args.get("command")
        return shell.bash(command) if isinstance(command, str) and command.strip() else "[bash needs a command]"
    if name == "submit":
        answer = args.get("answer")
        return shell.submit(answer if isinstance(answer, str) else None)
    return f"[unknown tool {name!r}: the tools are bash and submit]"
