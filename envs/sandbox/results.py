"""What a sandbox's commands run under (``Limits``) and give back (``RunResult``), and the
error it raises when it cannot run them with the isolation asked for."""

from __future__ import annotations

import dataclasses
import signal


class SandboxError(RuntimeError):
    """The sandbox cannot run commands with the isolation that was asked for."""


@dataclasses.dataclass(frozen=True)
class Limits:
    """Per-command limits. ``memory_bytes`` caps the memory of all the sandbox's processes
    (and, with ``disk="tmpfs"``, its files) together where a cgroup is available
    (``Isolation.memory``) and each process's address space everywhere; without a cgroup,
    ``processes`` x ``memory_bytes`` is the bound. ``cpus``: cores of CPU time for all its
    processes together (``Isolation.cpu``); ``cpu_seconds`` caps each process.
    ``disk_bytes``: the size of each of the sandbox's disks (``Isolation.disk``), read when
    the sandbox is made; ``file_bytes`` caps one file."""

    wall_seconds: float = 30.0
    cpu_seconds: int = 30
    memory_bytes: int = 2 << 30
    processes: int = 64
    file_bytes: int = 64 << 20
    open_files: int = 256
    output_bytes: int = 256 << 10
    disk_bytes: int = 1 << 30
    cpus: float = 1.0

    def __post_init__(self):
        for field in dataclasses.fields(self):
            if getattr(self, field.name) <= 0:
                raise ValueError(f"Limits.{field.name} must be > 0, got {getattr(self, field.name)!r}")

    def replace(self, **changes) -> "Limits":
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True)
class RunResult:
    """One command. ``killed``: None | "timeout" | "output_limit" | "memory_limit" (the
    sandbox's cgroup passed its limit and the kernel killed a process); ``signal``: the signal
    that ended the command (SIGXCPU/SIGKILL for CPU, SIGXFSZ for file size) or None;
    ``disk_full``: the disk quota, when the command ended with the agent's disk full (the
    status line then says so beside the command's own "No space left on device")."""

    returncode: int
    output: str
    seconds: float
    killed: str | None = None
    truncated: bool = False
    disk_full: int | None = None  # the quota in bytes, when the command left the agent's disk full

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.killed is None

    @property
    def signal(self) -> str | None:
        return signal.Signals(-self.returncode).name if self.returncode < 0 else None

    def summary(self, timing: bool = True) -> str:
        why = self.killed or self.signal or f"exit {self.returncode}"
        notes = ([f"{self.seconds:.2f}s"] if timing else []) + (["output truncated"] if self.truncated else []) \
            + ([f"disk full: {self.disk_full >> 20} MiB quota"] if self.disk_full else [])
        return "[" + ", ".join([why] + notes) + "]"
