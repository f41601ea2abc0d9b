"""Tasks, sandboxes and verifiers for RL; imports nothing from rl/ or glmjax/ (and needs no jax).

The public API, importable from `envs`:

    Task, TextTask, Step, Transcript, is_full   the contract with the RL loop (base.py)
    make_tasks, split_of                        procedural and sandboxed task families (families/)
    HarborTask, load_tasks, validate            the task format and its three checks (harbor/)
    DatasetTask, load_dataset, split_dataset    prompt datasets as JSONL, with verifiers (datasets.py)
    Sandbox, Limits                             isolated command execution (sandbox/)
    ShellEnv                                    a multi-turn episode of a HarborTask in a Sandbox
    RewardConfig                                how the reward the loop sees is shaped (reward.py)

    base.py        Task, TextTask (+ TextEnv), the action format, Step, Transcript
    sandbox/       Sandbox: own uids, quotas, PID/network/IPC/mount namespaces, cgroups, the helpers
                   that fork sandboxed commands, directory trees walked through fds
    image/         a task image emulated on the host: its Dockerfile, its scripts' install steps,
                   and the apt/pip/uv stand-ins
    harbor/        Harbor / Terminal-Bench tasks: run one in a sandbox (task.py), load and export
                   directories (dirs.py), what a run changed (changes.py), the three checks (validate.py)
    shell.py       ShellEnv: multi-turn episodes of a HarborTask in a Sandbox
    workers/       where episodes' ShellEnvs live: this process, or Ray actors on a cluster
    tool_calls.py  action formats: a model's turn read as commands and a submit
    families/      procedural text tasks and sandboxed task patterns; make_tasks(...)
    datasets.py    prompt datasets as JSONL files (our schema, GSM8K, MATH, MBPP, HumanEval, chat rows)
    verifiers/     the verifier kinds of a dataset row: exact, number, math (sympy), regex, python (sandboxed)
    generate.py    pattern -> env -> judge -> verifier -> checks -> registry
    models.py      ModelClient protocol; OpenAI-compatible, scripted and oracle clients
    evaluate.py    the evaluation matrix (per category and sub-metric, pass@k with CIs)
    augment.py     perturbations that keep the verified answer
    reward.py      the reward function, with optional shaping by difficulty
    cli.py         glmjax-envs info | validate | export | generate | run | eval
"""

from envs.base import Step, Task, TextTask, Transcript, is_full
from envs.datasets import DatasetTask
from envs.datasets import load_tasks as load_dataset
from envs.datasets import split as split_dataset
from envs.families import make_tasks, split_of
from envs.harbor.dirs import load_tasks
from envs.harbor.task import HarborTask
from envs.harbor.validate import validate
from envs.reward import RewardConfig
from envs.sandbox import Limits, Sandbox
from envs.shell import ShellEnv

__all__ = ["DatasetTask", "HarborTask", "Limits", "RewardConfig", "Sandbox", "ShellEnv", "Step", "Task", "TextTask",
           "Transcript", "is_full", "load_dataset", "load_tasks", "make_tasks", "split_dataset", "split_of", "validate"]
