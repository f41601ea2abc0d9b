"""Where episodes' environments run: pools that hand out environments with ``ShellEnv``'s
interface, one per episode.

    envs = InProcess()                    # or RayWorkers(4, address="host:port")
    env = envs.env(max_turns=4)           # a ShellEnv, or a RemoteEnv pinned to one worker at reset
    ...
    envs.close()

    in_process.py   InProcess: ShellEnvs in this process (the job's env.backend="thread")
    ray_backend.py  RayWorkers: ShellEnvs in Ray actors on this machine or a cluster
                    (env.backend="ray"); a dead worker's episodes raise WorkerLost
"""

from envs.workers.in_process import InProcess
from envs.workers.ray_backend import RayWorkers, RemoteEnv, WorkerLost

__all__ = ["InProcess", "RayWorkers", "RemoteEnv", "WorkerLost"]
