"""Tasks, sandboxes and verifiers for RL; imports nothing from rl/ (and needs no jax).

    base.py       Task, TextTask (+ TextEnv), the action format, Step, Transcript
    sandbox.py    Sandbox: isolated commands (own uid, rlimits, PID/network/mount namespaces)
    isolation.py  what the sandboxed child does before exec; probe() of what the kernel allows
    launcher.py   the helper processes that fork sandboxed commands (never the caller)
    harbor.py     HarborTask; Harbor / Terminal-Bench directories: load, run locally, export
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
