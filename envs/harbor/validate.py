"""The three-check verifier test. A task whose verifier fails any check never enters training.

1. Oracle: the reference solution must earn the full reward (1.0).
2. No-op: a run that does nothing must earn 0.
3. Unfinished: runs stopped partway must earn 0. Three kinds of probe:
   - cuts of the oracle script after several of its statements (``cut_points``:
     syntactically complete prefixes of ``solve.sh``, spread through it, the latest
     possible cut always included);
   - states derived from the oracle's effect on the working directory
     (``envs/harbor/changes.py``): every change but the last write, the last write cut short,
     and halfway; these make one-command oracles checkable;
   - every partial solution the task provides.
   A probe whose working directory ends up identical to the oracle's (only no-op
   statements were left) or to the untouched one (the no-op check's) is not unfinished
   and is skipped, reported as such. With no probe left the check fails: an unchecked
   verifier is a rejected one.

A multi-step task (``HarborTask.steps``) is checked as a trial: the oracle solves each
step after the earlier steps' solutions (trial reward 1.0), doing nothing scores 0 on
every step reached, and each step's unfinished runs, made after the earlier steps'
solutions, score 0 on that step's tests (every step needs a probe of its own).

For a ``TextTask`` the same checks run on text: the oracle answer; the empty completion
(with and without the terminator); every strict prefix of the answer (with and without
the terminator) and the family's partial answers.

Every sandboxed run uses a fresh ``Sandbox``. ``TaskReport.to_dict()`` is the JSON
report, with the sandbox's isolation and how the task's install steps were resolved;
``status`` is "pass", "fail", "unsupported" (the environment cannot be set up locally:
``envs/harbor/dirs.py``) or "error" (the task could not be loaded, or the check itself could
not run; the reason says which). One task's error is that task's report, never the end
of a ``validate_all`` run.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

from envs.base import TextTask, is_full, is_zero
from envs.harbor import changes
from envs.harbor.task import (
    HarborTask,
    UnsupportedTask,
    prepare,
    run_script,
    run_tests,
    stops_after,
    task_limits,
    task_sandbox,
    trial_reward,
)
from envs.sandbox.sandbox import Limits, SandboxError, probe

_HEREDOC = re.compile(r"<<-?\s*(['\"]?)([A-Za-z_][A-Za-z0-9_]*)\1")
_TRIVIAL = re.compile(r"^\s*(#.*|set\s+-[euxo\w\s]+|cd\s+\S+|)\s*$")


@dataclasses.dataclass
class Check:
    name: str
    passed: bool
    detail: str
    probes: list[dict] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class TaskReport:
    task_id: str
    status: str
    checks: list[Check]
    seconds: float
    source: str | None = None
    reason: str | None = None
    environment: dict = dataclasses.field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.status == "pass"

    def to_dict(self) -> dict:
        return {"task": self.task_id, "status": self.status, "source": self.source, "reason": self.reason,
                "seconds": round(self.seconds, 3), "checks": {c.name: dataclasses.asdict(c) for c in self.checks},
                "environment": self.environment}


def cut_points(script: str, n: int = 3) -> list[str]:
    """Up to ``n`` prefixes of ``script`` that end after a complete statement: outside
    here-documents, accepted by ``bash -n``, with real work (not only shebang, ``set`` and
    ``cd`` lines) both before and after the cut. Spread evenly; the latest always kept."""
    lines = script.splitlines(keepends=True)
    work = [not _TRIVIAL.match(line) for line in lines]
    candidates, inside = [], None
    for i, line in enumerate(lines):
        if inside is not None:
            if line.strip() != inside:
                continue
            inside = None
        else:
            opened = _HEREDOC.search(line)
            if opened:
                inside = opened.group(2)
                continue
            if not work[i]:
                continue
        if any(work[: i + 1]) and any(work[i + 1:]):
            candidates.append(i + 1)
    good = [c for c in candidates if _parses("".join(lines[:c]))]
    if len(good) > n:
        good = sorted({good[round(j * (len(good) - 1) / (n - 1))] for j in range(n)}) if n > 1 else good[-1:]
    return ["".join(lines[:c]) for c in good]


def _parses(script: str) -> bool:
    return subprocess.run(["/bin/bash", "-n"], input=script.encode(), capture_output=True).returncode == 0


def _validate_text(task: TextTask, t0: float) -> TaskReport:
    oracle = task.verify(task.oracle())
    noop = [("", task.verify("")), (task.terminator, task.verify(task.terminator))]
    body = task.extract(task.oracle())
    probes = [p for k in range(1, len(body)) for p in (body[:k], body[:k] + task.terminator)]
    probes = [(p, task.verify(p)) for p in dict.fromkeys(probes + list(task.partials))
              if task.extract(p) != body]
    checks = [
        Check("oracle", is_full(oracle), f"oracle {task.oracle()!r} scored {oracle}"),
        Check("noop", all(is_zero(r) for _, r in noop), f"empty completions scored {[r for _, r in noop]}",
              [{"completion": c, "reward": r} for c, r in noop]),
        Check("unfinished", all(is_zero(r) for _, r in probes),
              f"{sum(not is_zero(r) for _, r in probes)} of {len(probes)} partial answers scored > 0" if probes
              else "a one-character answer: its only partial answer is the empty one (the no-op check)",
              [{"completion": c, "reward": r} for c, r in probes]),
    ]
    return TaskReport(task.id, "pass" if all(c.passed for c in checks) else "fail", checks, time.monotonic() - t0)


@dataclasses.dataclass
class _Run:
    verdict: object
    ran: object  # the solution's RunResult, or None
    state: str  # snapshot of /app before the tests
    start: str  # snapshot of /app before the script (after the earlier steps' solutions)
    change: changes.Changes | None = None


def _episode(task: HarborTask, script: str | None, limits: Limits, sandbox_args: dict, *,
             step: HarborTask | None = None, prior: tuple[HarborTask, ...] = (), ops: list[changes.Op] = (),
             capture: bool = False) -> _Run:
    """One run in a fresh sandbox: prepare ``task``, run the solutions of the ``prior``
    steps, apply ``ops``, run ``script``, run the tests of ``step`` (default: ``task``).
    ``capture``: also record what the script changed in /app."""
    target = step or task
    with task_sandbox(task, limits, **sandbox_args) as sandbox:
        prepare(sandbox, task)
        for done in prior:
            run_script(sandbox, done, done.solution)
        top = sandbox.host_path("/app")
        before = changes.listing(top)
        changes.apply(sandbox, list(ops))
        ran = run_script(sandbox, target, script) if script is not None else None
        after = changes.listing(top)
        change = changes.diff(before, after, top) if capture else None
        return _Run(run_tests(sandbox, target), ran, changes.digest(after), changes.digest(before), change)


def _validate_harbor(task: HarborTask, t0: float, cuts: int, limits: Limits, sandbox_args: dict) -> TaskReport:
    environment = {"isolation": probe().describe(), "installs": list(task.installs), "notes": list(task.notes),
                   "layer": task.layer}
    report = lambda status, checks, reason=None: TaskReport(  # noqa: E731
        task.id, status, checks, time.monotonic() - t0, task.source, reason, environment)
    if task.unsupported:
        return report("unsupported", [], task.unsupported)
    steps = task.steps or (task,)
    missing = [s.id for s in steps if s.solution is None]
    if missing:
        return report("fail", [], f"no solution/solve.sh for {', '.join(missing)}: the oracle check cannot run")
    limits = task_limits(task, limits)
    try:
        checks, oracle_output = _multi_step_checks(task, cuts, limits, sandbox_args) if task.steps else \
            _checks(task, cuts, limits, sandbox_args)
    except UnsupportedTask as err:
        return report("unsupported", [], str(err))
    except SandboxError as err:
        return report("error", [], f"sandbox: {err}")
    why = _sandbox_limit(oracle_output) if not checks[0].passed else None
    if why:
        return report("unsupported", checks, f"the oracle fails here because {why}")
    return report("pass" if all(c.passed for c in checks) else "fail", checks)


_LIMITS = (  # what a failed oracle's output says when the sandbox, not the task, is at fault
    (re.compile(r"(?:^|\n)(?:\S+: )?(?:line )?(?:\d+: )?([\w.+-]+): (?:command )?not found"),
     "it needs {0}, which this host lacks"),
    (re.compile(r"(?<![\w./-])(/(?!(?:app|tmp|logs|tests|solution)/)[\w./-]+)'?: Read-only file system|"
                r"Read-only file system: '(/(?!(?:app|tmp|logs|tests|solution)/)[\w./-]+)'"),
     "it changes {0}, which the sandbox keeps read-only (only what is inside /app, /tmp, /logs, /tests and "
     "/solution is writable)"),
    (re.compile(r"'?(/tests|/logs/verifier)(?:/[\w./-]*)?'?: Permission denied"),
     "it touches {0}, which only the verifier may use (its files are copied in when the tests run)"),
    (re.compile(r"File too large|File size limit exceeded"),
     "it writes a file larger than the sandbox allows (the task's [environment] storage_mb raises the cap)"),
    (re.compile(r"Operation not permitted|must be (?:run as )?root|are you root"),
     "it needs root, and sandboxed commands run as an unprivileged user"),
    (re.compile(r"Connection refused|Failed to connect"),
     "the tests reach a service, and processes the solution starts do not outlive its command in the sandbox"),
)


def _sandbox_limit(output: str) -> str | None:
    """Why a failed oracle run failed, when the cause is a limit of the sandbox (a missing
    tool, a read-only system directory, no root, no background services); else None."""
    for pattern, why in _LIMITS:
        found = pattern.search(output)
        if found:
            return why.format(*[g for g in found.groups() if g is not None])
    return None


def _oracle_detail(run: _Run) -> str:
    verdict, ran = run.verdict, run.ran
    own = "" if verdict.reward >= 1.0 or not ran.output.strip() else f" ...{ran.output[-400:]}"
    return f"solve.sh {ran.summary()}{own}; {verdict.detail()}"


def _output(run: _Run) -> str:
    """What a run printed: the solution's output, then the tests'."""
    return (run.ran.output if run.ran else "") + "\n" + run.verdict.result.output


def _checks(task: HarborTask, cuts: int, limits: Limits, sandbox_args: dict) -> tuple[list[Check], str]:
    """The three checks, and the oracle run's output."""
    oracle = _episode(task, task.solution, limits, sandbox_args, capture=True)
    verdict = oracle.verdict
    checks = [Check("oracle", is_full(verdict.reward), _oracle_detail(oracle),
                    [{"reward": verdict.reward, "source": verdict.source}])]
    noop = _episode(task, None, limits, sandbox_args)
    checks.append(Check("noop", is_zero(noop.verdict.reward), noop.verdict.detail(),
                        [{"reward": noop.verdict.reward, "source": noop.verdict.source}]))
    probes = _unfinished_probes(task, task, (), oracle, cuts, limits, sandbox_args)
    checks.append(_unfinished_check(probes))
    return checks, _output(oracle)


def _multi_step_checks(task: HarborTask, cuts: int, limits: Limits, sandbox_args: dict) -> tuple[list[Check], str]:
    """The three checks on the trial: the oracle solves each step after the earlier ones'
    solutions (trial reward 1); doing nothing scores 0 on every step; each step's
    unfinished runs, after the earlier steps' solutions, score 0 on that step."""
    oracles = [_episode(task, s.solution, limits, sandbox_args, step=s, prior=task.steps[:k], capture=True)
               for k, s in enumerate(task.steps)]
    rewards = [r.verdict.reward for r in oracles]
    per_step = [{"step": s.id, "reward": r.verdict.reward, "source": r.verdict.source}
                for s, r in zip(task.steps, oracles)]
    failed = [(s, r) for s, r in zip(task.steps, oracles) if not is_full(r.verdict.reward)]
    detail = (f"trial reward {trial_reward(task, rewards)} ({task.step_reward} of {rewards})"
              + (f"; {failed[0][0].id}: {_oracle_detail(failed[0][1])}" if failed else ""))
    checks = [Check("oracle", not failed and is_full(trial_reward(task, rewards)), detail, per_step)]
    noop_rewards, noop_probes = [], []
    for s in task.steps:
        run = _episode(task, None, limits, sandbox_args, step=s)
        noop_rewards.append(run.verdict.reward)
        noop_probes.append({"step": s.id, "reward": run.verdict.reward, "source": run.verdict.source})
        if stops_after(s, run.verdict.reward):
            break
    trial = trial_reward(task, noop_rewards)
    checks.append(Check("noop", is_zero(trial), f"trial reward {trial} ({task.step_reward} of {noop_rewards})",
                        noop_probes))
    probes, unchecked = [], []
    for k, (s, oracle) in enumerate(zip(task.steps, oracles)):
        found = _unfinished_probes(task, s, task.steps[:k], oracle, cuts, limits, sandbox_args)
        if not any("reward" in p for p in found):
            unchecked.append(s.id)
        probes += [{"step": s.id, **p} for p in found]
    check = _unfinished_check(probes)
    if unchecked and check.passed:
        check = Check("unfinished", False, f"no unfinished probe for {', '.join(unchecked)}; {check.detail}", probes)
    checks.append(check)
    return checks, _output(failed[0][1]) if failed else ""


def _unfinished_probes(task: HarborTask, step: HarborTask, prior: tuple, oracle: _Run, cuts: int, limits: Limits,
                       sandbox_args: dict) -> list[dict]:
    """Runs of ``step`` stopped partway (cuts, states from the oracle's changes, partials),
    each scored by the step's tests; those that end as the oracle or as the untouched
    directory are skipped."""
    probes = []
    runs = [({"kind": "cut", "lines": c.count("\n")}, c, ()) for c in cut_points(step.solution, cuts)]
    if oracle.change is not None and oracle.change.too_large:
        probes.append({"kind": "state", "skipped": f"the oracle changed more than {changes.MAX_BYTES} bytes"})
    elif oracle.change is not None:
        runs += [({"kind": "state", "name": name, "left_out_or_cut": paths[:20]}, None, ops)
                 for name, ops, paths in oracle.change.partial_states()]
    runs += [({"kind": "partial", "lines": p.count("\n")}, p, ()) for p in step.partials]
    for info, script, ops in runs:
        run = _episode(task, script, limits, sandbox_args, step=step if step is not task else None, prior=prior,
                       ops=ops)
        if info["kind"] != "partial" and run.state in (oracle.state, oracle.start):
            same = "the oracle's" if run.state == oracle.state else "the untouched directory (the no-op check)"
            probes.append({**info, "skipped": f"same final state as {same}"})
            continue
        probes.append({**info, "reward": run.verdict.reward, "source": run.verdict.source})
    return probes


def _unfinished_check(probes: list[dict]) -> Check:
    ran_probes = [p for p in probes if "reward" in p]
    failed = sum(not is_zero(p["reward"]) for p in ran_probes)
    if not ran_probes:
        detail = ("no unfinished probe: no cut point of solve.sh or part of the oracle's changes leaves a "
                  "different state, and there are no partial solutions")
    else:
        detail = f"{failed} of {len(ran_probes)} unfinished runs scored > 0"
        passed_anyway = [p for p in ran_probes if not is_zero(p["reward"]) and p["kind"] == "state"]
        if passed_anyway:
            p = passed_anyway[0]
            detail += (f"; e.g. {p['name']} ({', '.join(p['left_out_or_cut'][:3])}) scored {p['reward']}: "
                       "the verifier does not check that part of the oracle's work")
    return Check("unfinished", bool(ran_probes) and failed == 0, detail, probes)


def validate(task, *, cuts: int = 3, limits: Limits = Limits(wall_seconds=60.0), network: str = "none",
             filesystem: str = "auto") -> TaskReport:
    """The three checks on one task (``TextTask`` or ``HarborTask``)."""
    t0 = time.monotonic()
    if isinstance(task, TextTask):
        return _validate_text(task, t0)
    if isinstance(task, HarborTask):
        return _validate_harbor(task, t0, cuts, limits, {"network": network, "filesystem": filesystem})
    raise TypeError(f"validate takes a TextTask or HarborTask, got {type(task).__name__}")


def _validate_one(task, **kw) -> TaskReport:
    """``validate``, with any failure of the check itself turned into this task's report."""
    t0 = time.monotonic()
    try:
        return validate(task, **kw)
    except Exception as err:  # a batch boundary: one task's failure must not end the run
        return TaskReport(getattr(task, "id", "?"), "error", [], time.monotonic() - t0, getattr(task, "source", None),
                          f"the check could not run: {type(err).__name__}: {err}")


def iter_validate(tasks, *, workers: int = 1, **kw):
    """``validate`` over many tasks, ``workers`` at a time: each report as soon as it and
    those before it are done, in input order."""
    if workers <= 1:
        yield from (_validate_one(t, **kw) for t in tasks)
        return
    with ThreadPoolExecutor(workers) as pool:
        yield from pool.map(lambda t: _validate_one(t, **kw), tasks)


def validate_all(tasks, *, workers: int = 1, **kw) -> list[TaskReport]:
    """``validate`` over many tasks, ``workers`` at a time; reports in input order."""
    return list(iter_validate(tasks, workers=workers, **kw))
