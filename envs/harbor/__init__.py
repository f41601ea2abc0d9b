"""The task format (Harbor / Terminal-Bench directories) and the checks a task must pass.

    task.py      HarborTask run in a sandbox: prepare, run the solution, run the verifier
    dirs.py      task directories: find, load, export
    changes.py   what a run changed in /app, and states that apply part of it
    validate.py  the three checks (oracle / no-op / unfinished), JSON reports
"""

from envs.harbor.task import HarborTask

__all__ = ["HarborTask"]
