"""Tasks, sandboxes and verifiers for RL; imports nothing from rl/ (and needs no jax).

    base.py       Task, TextTask (+ TextEnv), the action format, Step, Transcript
    sandbox.py    Sandbox: isolated commands (own uids, quotas, PID/network/IPC/mount namespaces)
    isolation.py  what the sandboxed child does before exec; probe() of what the kernel allows
    launcher.py   the helper processes that fork sandboxed commands (never the caller)
    cgroup.py     one cgroup per sandbox: memory cap and CPU quota for all its processes together
    tree.py       walk, hash, read and remove directory trees of any depth
    host_tools.py what the host offers in place of an image's packages; apt/pip/uv/uvx stand-ins
    shell_syntax.py  the simple commands of a shell script, found without running it
    installs.py   a script's install steps, resolved against the host
    dockerfile.py a task's Dockerfile, emulated without Docker
    harbor.py     HarborTask run in a sandbox: prepare, run the solution, run the verifier
    harbor_dirs.py  Harbor / Terminal-Bench task directories: find, load, export
    changes.py    what a run changed in /app, and states that apply part of it
    shell.py      ShellEnv: multi-turn episodes of a HarborTask in a Sandbox
    validate.py   the three checks (oracle / no-op / unfinished), JSON reports
    families/     procedural text tasks and sandboxed task patterns; make_tasks(...)
    generate.py   pattern -> env -> judge -> verifier -> checks -> registry
    models.py     ModelClient protocol; OpenAI-compatible, scripted and oracle clients
    evaluate.py   the evaluation matrix (per category and sub-metric, pass@k with CIs)
    augment.py    perturbations that keep the verified answer
    reward.py     the reward function, with optional shaping by difficulty
    cli.py        glmjax-envs info | validate | export | generate | run | eval
"""
