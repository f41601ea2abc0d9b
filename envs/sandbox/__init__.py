"""Isolated command execution for a hostile agent.

    sandbox.py    Sandbox: own uids, quotas, PID / network / IPC / mount namespaces
    isolation.py  what the sandboxed child does before exec; probe() of what the kernel allows
    anchor.py     an episode's anchor: init of its namespaces, which starts each agent command in them
    launcher.py   the helper processes that fork sandboxed commands (never the caller)
    tools.py      the tools mounted at /glmjax and the interpreter prefixes they run from
    results.py    Limits, RunResult, SandboxError
    cgroup.py     one cgroup per sandbox: memory cap and CPU quota for all its processes together
    tree.py       walk, hash, read and remove directory trees of any depth
    layers.py     an image's layer laid read-only over a sandbox's root
    build.py      the build sandbox: a Dockerfile's RUN lines as root, writing only the layer
"""

from envs.sandbox.sandbox import Limits, RunResult, Sandbox, SandboxError, probe

__all__ = ["Limits", "RunResult", "Sandbox", "SandboxError", "probe"]
