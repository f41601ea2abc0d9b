"""Agents written only against the OpenAI chat API: given a client (a base URL and key),
a model name, a task's instruction and the environment's tools, they run an episode.

    AGENTS["terminus"](client, model, instruction, shell, max_turns=8)

An agent is one function in ``AGENTS``; the RL job (``task.agent``, rl/agent_episode.py)
points it at the engine's OpenAI-compatible server, which records every call's tokens.
"""

from envs.agents.terminus import SHELL_TOOLS, AgentRun, Shell, terminus

AGENTS = {"terminus": terminus}

__all__ = ["AGENTS", "SHELL_TOOLS", "AgentRun", "Shell", "terminus"]
