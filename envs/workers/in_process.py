"""Environments in the trainer's own process: each episode's ``ShellEnv`` is made here and
its work runs in the caller's thread (the collector's pool)."""

from __future__ import annotations

from envs.shell import ShellEnv


class InProcess:
    def env(self, **shell_args) -> ShellEnv:
        return ShellEnv(**shell_args)

    def close(self) -> None:
        pass
