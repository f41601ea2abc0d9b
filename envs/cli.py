"""glmjax-envs: validate, run, export, generate and evaluate environments.

    glmjax-envs info                                  # which sandbox isolation is active here
    glmjax-envs validate TASKS_DIR... [--out REPORTS] # the three checks; exit 0 only if all pass
    glmjax-envs export terminal OUT --n 10 --seed 0   # generated tasks as Harbor directories
    glmjax-envs generate OUT --family terminal=16 --family arithmetic=10
    glmjax-envs run TASK_DIR --model oracle           # one episode; prints the transcript
    glmjax-envs eval --model openai:http://127.0.0.1:8000/v1#glm --n-tasks 5 --samples 4 --k 1,4

Models (``--model``, ``--author``, ``--verifier``, ``--judge``): ``openai:URL#name`` (an
OpenAI-compatible completions endpoint), ``oracle`` (the tasks' reference solutions),
``noop`` (submits at once), ``engine:...`` (the glmjax engine, once its adapter exists).

Bad input (a missing directory, a malformed task, an unknown family or model, an
unsupported task for ``run``) ends with a one-line ``glmjax-envs CMD: error: ...`` after
the usage line, exit status 2; in ``validate`` a task that cannot be loaded is that
task's error report and the others still run.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import sys
import threading

from envs import evaluate, families, models
from envs.generate import generate
from envs.harbor import dirs as harbor_dirs
from envs.harbor import task as harbor
from envs.harbor import validate
from envs.sandbox import sandbox
from envs.shell import ShellEnv


class UsageError(Exception):
    """Bad input from the command line; the message says what and how to fix it."""


# Errors that report bad input, shown as one line (anything else is a bug: a traceback)
_INPUT_ERRORS = (UsageError, harbor_dirs.HarborFormatError, harbor.UnsupportedTask, sandbox.SandboxError,
                 models.ModelError,
                 FileNotFoundError, NotADirectoryError, IsADirectoryError, FileExistsError, PermissionError)


def _client(spec: str, **kw):
    try:
        return models.client_from_spec(spec, **kw)
    except (ValueError, NotImplementedError) as err:
        raise UsageError(f"--model {spec!r}: {err}") from None


def _out_dir(path: str | None) -> str | None:
    if path and os.path.exists(path) and not os.path.isdir(path):
        raise UsageError(f"--out {path!r} is a file; give a directory for the reports")
    return path


def _ints(text: str) -> list[int]:
    try:
        values = [int(k) for k in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"values must be >= 1, got {text!r}")
    return values


def _family_count(text: str) -> tuple[str, int]:
    name, _, n = text.partition("=")
    if name not in families.names():
        raise argparse.ArgumentTypeError(f"unknown family {name!r}; known: {', '.join(families.names())}")
    try:
        count = int(n or 1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: COUNT must be an integer (NAME=COUNT)") from None
    return name, count


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _info(args) -> int:
    print(json.dumps(sandbox.probe().__dict__ | {"describe": sandbox.probe().describe()}, indent=1))
    return 0


def _validate(args) -> int:
    _out_dir(args.out)
    paths = harbor_dirs.find_tasks(args.dirs)
    if not paths:
        raise UsageError(f"no task directories (with task.toml or task.yaml) under {', '.join(args.dirs)}")
    tasks, failed_loads = [], []
    for path in paths:
        try:
            tasks.append(harbor_dirs.load_task(path))
        except (OSError, ValueError) as err:  # one task's bad files are that task's report
            failed_loads.append(validate.TaskReport(os.path.basename(path), "error", [], 0.0, path,
                                                    f"cannot load: {err}"))
    reports, names = [], set()
    for report in itertools.chain(failed_loads, validate.iter_validate(tasks, workers=args.workers, cuts=args.cuts,
                                                                     network=args.network)):
        reports.append(report)  # each report is out as soon as it is done: a killed run keeps them
        data = report.to_dict()
        print(json.dumps(data), flush=True)
        if args.out:
            name = _unique(report.task_id, names)  # public tasks often share a name
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, f"{name}.json"), "w") as f:
                json.dump(data, f, indent=1)
    passed = sum(r.passed for r in reports)
    for report in reports:
        failed = ", ".join(c.name for c in report.checks if not c.passed) or report.reason or ""
        print(f"{report.status:<12} {report.task_id:<32} {failed}  ({report.source})", file=sys.stderr)
    print(f"{passed}/{len(reports)} tasks pass all three checks", file=sys.stderr)
    return 0 if passed == len(reports) else 1


def _unique(name: str, taken: set) -> str:
    candidate, n = name, 1
    while candidate in taken:
        n += 1
        candidate = f"{name}-{n}"
    taken.add(candidate)
    return candidate


def _export(args) -> int:
    if args.family not in families.SANDBOX:
        raise UsageError(f"family {args.family!r} does not export to Harbor; sandboxed families: "
                         f"{', '.join(sorted(families.SANDBOX))}")
    for task in families.make_tasks(args.family, args.n, seed=args.seed, difficulty=args.difficulty):
        print(harbor_dirs.export_task(task, args.out))
    return 0


def _generate(args) -> int:
    counts = dict(args.family or [("terminal", 8)])
    client = lambda spec: _client(spec) if spec else None  # noqa: E731
    registry = generate(args.out, families_n=counts, seed=args.seed, author=client(args.author),
                        verifier=client(args.verifier), judge_client=client(args.judge), workers=args.workers)
    print(json.dumps(registry.counts(), indent=1))
    return 0 if registry.accepted else 1


def _run(args) -> int:
    task = harbor_dirs.load_task(args.task)
    client = _client(args.model, tasks=[task])
    env = ShellEnv(max_turns=args.max_turns)
    try:
        env.reset(task)
        done = False
        while not done:
            _, reward, done, _ = env.step(client.complete(env.transcript.render(), max_tokens=args.max_tokens))
        print(env.transcript.to_json())
    finally:
        env.close()
    return 0 if reward >= 1.0 else 1


def _eval(args) -> int:
    categories = args.categories.split(",")
    unknown = set(categories) - set(evaluate.CATEGORIES)
    if unknown:
        raise UsageError(f"--categories: unknown {', '.join(sorted(unknown))}; known: "
                         f"{', '.join(sorted(evaluate.CATEGORIES))}")
    if args.out and os.path.isdir(args.out):
        raise UsageError(f"--out {args.out!r} is a directory; give the path of the JSON report")
    tasks = {c: evaluate.heldout(c, args.n_tasks, args.seed) for c in categories}
    client = _client(args.model, tasks=[t for ts in tasks.values() for t in ts])
    report = evaluate.evaluate(client, categories=categories, tasks=tasks, samples=args.samples,
                               ks=args.k, seed=args.seed, model=args.model,
                               temperature=args.temperature, max_turns=args.max_turns)
    print(evaluate.table(report), file=sys.stderr)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    print(json.dumps(report))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="glmjax-envs", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="the sandbox isolation active on this machine").set_defaults(fn=_info)
    p = sub.add_parser("validate", help="the three checks on Harbor / Terminal-Bench task directories")
    p.add_argument("dirs", nargs="+")
    p.add_argument("--out", help="directory for one JSON report per task")
    p.add_argument("--cuts", type=_positive, default=3, help="cut points through solve.sh")
    p.add_argument("--workers", type=_positive, default=1)
    p.add_argument("--network", choices=["none", "host"], default="none")
    p.set_defaults(fn=_validate)
    p = sub.add_parser("export", help="generated tasks as Harbor task directories")
    p.add_argument("family")
    p.add_argument("out")
    p.add_argument("--n", type=_positive, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--difficulty", type=int, choices=range(1, 6))
    p.set_defaults(fn=_export)
    p = sub.add_parser("generate", help="pattern -> env -> judge -> verifier -> checks -> registry")
    p.add_argument("out")
    p.add_argument("--family", action="append", type=_family_count, help="NAME=COUNT (repeatable)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=_positive, default=1)
    p.add_argument("--author", help="model that writes solutions (default: the pattern's own)")
    p.add_argument("--verifier", help="model that writes verifiers from the spec (default: the pattern's own)")
    p.add_argument("--judge", help="model asked whether each task is solvable")
    p.set_defaults(fn=_generate)
    p = sub.add_parser("run", help="one episode of a task directory")
    p.add_argument("task")
    p.add_argument("--model", default="oracle")
    p.add_argument("--max-turns", type=_positive, default=8)
    p.add_argument("--max-tokens", type=_positive, default=512)
    p.set_defaults(fn=_run)
    p = sub.add_parser("eval", help="the evaluation matrix on held-out task sets")
    p.add_argument("--model", default="oracle")
    p.add_argument("--categories", default=",".join(evaluate.CATEGORIES))
    p.add_argument("--n-tasks", type=_positive, default=4, help="held-out tasks per family")
    p.add_argument("--samples", type=_positive, default=1)
    p.add_argument("--k", type=_ints, default=[1], help="comma-separated k of pass@k")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--max-turns", type=_positive, default=8)
    p.add_argument("--out", help="where to write the JSON report")
    p.set_defaults(fn=_eval)
    args = parser.parse_args(argv)
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminate) if main_thread else None
    try:
        return args.fn(args)
    except _INPUT_ERRORS as err:
        command = sub.choices[args.command]
        command.print_usage(sys.stderr)
        message = "; ".join(line.strip() for line in str(err).splitlines() if line.strip())
        print(f"{command.prog}: error: {message}", file=sys.stderr)
        return 2
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)


def _terminate(signum, frame):
    """SIGTERM unwinds like Ctrl-C, so that open sandboxes kill their commands and remove
    their directories on the way out."""
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    sys.exit(main())
