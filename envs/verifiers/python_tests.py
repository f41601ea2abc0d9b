"""The kind ``python``: the code of a completion, and the sandboxed harness that runs the row's tests.

The python harness, and what an RL policy could try against it:
- An early clean exit (``os._exit(0)``, ``sys.exit(0)``, ``exec`` of ``/bin/true``, a
  killed test process) is not a pass. The tests run in a child process; the harness (the
  child's parent, PID 1 of the sandbox, not ptrace-able) writes a random nonce into a pipe
  that the child reads only after the last test statement, through a file descriptor
  placed at a random number, and echoes back through another; the verdict is 0 only
  for a child that exited 0 and echoed the nonce.
- Output is ignored: printing "OK" or "passed" does nothing. No file is read back, so
  writing one (``/logs/verifier/reward.txt``) does nothing.
- The tests never touch the disk: they reach the harness on its stdin, which is read
  and closed before the solution runs; the dataset's own directory is hidden from the
  sandbox. A solution that opens the test or data file finds nothing.
- The tests see the builtins as they were before the solution ran (patching
  ``builtins.sorted`` or ``builtins.exec`` changes nothing for them).
- ``assert x == y`` and ``assert x != y`` compare through a check that refuses an
  always-equal object: when one side holds only values of types whose equality is the
  interpreter's (ints, strings, lists ..., and standard ones such as ``Counter``) and the
  other holds a value whose ``__eq__`` / ``__ne__`` is defined by Python code elsewhere
  (a class of the solution, ``unittest.mock.ANY``), the assertion fails.
- Infinite loops end at the wall clock; fork bombs at the process limit; memory hogs at
  the cgroup and address-space caps; output floods at the output cap. Each scores 0.
Not covered: a solution that deliberately tampers with the process it shares with the
tests (reads the expected values out of the calling frame's constants, scans its file
descriptors for the nonce, patches a module the tests import, uses ctypes) can fool an
in-process test. Tests are statements that raise on failure (MBPP / HumanEval asserts);
``unittest.main()`` exits, which counts as a failure.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import math
import re
import shlex
from typing import ClassVar

from envs.base import FULL_REWARD
from envs.sandbox.sandbox import Limits, RunResult, Sandbox
from envs.verifiers.kind import FieldError, _above, _Kind


@dataclasses.dataclass(frozen=True)
class Python(_Kind):
    tests: str
    timeout: float = 10.0
    memory_mb: int = 1024
    demonstrable: bool = True
    hide: tuple[str, ...] = ()  # host directories the sandbox must not show (the dataset's)
    OPTIONS: ClassVar = {"timeout": float, "memory_mb": int}
    RUNS_TESTS: ClassVar = True

    def __post_init__(self):
        _above("timeout", self.timeout)
        _above("memory_mb", self.memory_mb)

    @classmethod
    def build(cls, answer, tests, source, **options) -> Python:
        if not tests:
            raise FieldError("tests", 'kind "python" needs the test code that the completion must pass')
        try:
            ast.parse(tests)
        except SyntaxError as err:
            raise FieldError("tests", f"not valid Python: {err.msg} (line {err.lineno})") from None
        return cls(tests, **options, demonstrable=answer is not None, hide=(source,) if source else ())

    def run(self, completion: str) -> RunResult:
        """The harness's run in a fresh sandbox (its output is for people; the verdict is its status)."""
        limits = Limits(wall_seconds=self.timeout, cpu_seconds=math.ceil(self.timeout) + 1,
                        memory_bytes=self.memory_mb << 20, processes=32, output_bytes=64 << 10)
        payload = json.dumps({"solution": python_code(completion), "tests": self.tests})
        with Sandbox(limits=limits, hide=self.hide) as sandbox:
            return sandbox.run(f"exec python3 -I -c {shlex.quote(_HARNESS)}", stdin=payload)

    def __call__(self, completion: str) -> float:
        result = self.run(completion)
        return FULL_REWARD if result.returncode == 0 and result.killed is None else 0.0


# ----- python: the code of a completion, and the harness that tests it --------------------------
_FENCE = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)```", re.DOTALL)
_PYTHON_TAGS = ("", "python", "python3", "py")


def python_code(completion: str) -> str:
    """The last ```python (or untagged) fenced block; an unclosed last fence's rest; else the whole text."""
    blocks = [m.group(2) for m in _FENCE.finditer(completion) if m.group(1).lower() in _PYTHON_TAGS]
    if blocks:
        return blocks[-1]
    opened = re.search(r"```[ \t]*(?:python3?|py)?[ \t]*\n", completion)
    return completion[opened.end():] if opened and "```" not in completion[opened.end():] else completion


# Run in the sandbox as `python3 -I -c HARNESS` with {"solution", "tests"} on stdin (see the
# module docstring). Everything the verdict depends on is bound before the solution runs.
_HARNESS = r'''
import ast, builtins, collections, json, os, random, resource, sys, traceback, types

_exit, _read, _write, _run = os._exit, os.read, os.write, exec
HEAP_TYPE = 1 << 9
MRO, DICT, FLAGS = (type.__dict__[k].__get__ for k in ("__mro__", "__dict__", "__flags__"))
CHECK = "__verifier_compare__"


def defining(cls, name):
    for k in MRO(cls):
        if name in DICT(k):
            return k, DICT(k)[name]
    return object, None


TRUSTED = {}  # standard classes whose equality is Python code, as they were before the solution ran
for cls in (collections.Counter,):
    for name in ("__eq__", "__ne__"):
        k, f = defining(cls, name)
        TRUSTED[(k, name)] = f


def trusted_type(t):
    for name in ("__eq__", "__ne__"):
        k, f = defining(t, name)
        if FLAGS(k) & HEAP_TYPE and TRUSTED.get((k, name), TRUSTED) is not f:
            return False
    return True


def honest(value, budget=1_000_000):
    stack, seen = [value], set()
    while stack:
        v = stack.pop()
        t = type(v)
        if not trusted_type(t):
            return False
        for base in (dict, list, tuple, set, frozenset):
            if issubclass(t, base) and id(v) not in seen:
                seen.add(id(v))
                stack.extend(list(dict.keys(v)) + list(dict.values(v)) if base is dict else base.__iter__(v))
                break
        if len(seen) > budget:
            return False
    return True


def compare(left, right, equal):
    if honest(left) != honest(right):
        return False
    return bool(left == right) if equal else bool(left != right)


class Rewrite(ast.NodeTransformer):
    def visit_Assert(self, node):
        self.generic_visit(node)
        t = node.test
        if isinstance(t, ast.Compare) and len(t.ops) == 1 and isinstance(t.ops[0], (ast.Eq, ast.NotEq)):
            node.test = ast.Call(ast.Name(CHECK, ast.Load()),
                                 [t.left, t.comparators[0], ast.Constant(isinstance(t.ops[0], ast.Eq))], [])
        return node


def child(solution, tests, nonce_fd, done_fd):
    clean = dict(builtins.__dict__)
    module = types.ModuleType("solution")
    sys.modules["solution"] = module
    try:
        _run(solution, module.__dict__)
        names = {k: v for k, v in module.__dict__.items() if not (k.startswith("__") and k.endswith("__"))}
        names.update({"__builtins__": clean, "__name__": "__tests__", CHECK: compare})
        _run(tests, names)
    except BaseException:  # SystemExit included: an exit before the tests end is a failure
        try:
            sys.stdout.flush()
            traceback.print_exc()
            sys.stderr.flush()
        finally:
            _exit(1)
    _write(done_fd, _read(nonce_fd, 64))
    _exit(0)


def main():
    payload = json.loads(sys.stdin.buffer.read())
    sys.stdin.close()
    os.close(0)
    try:
        solution = compile(payload["solution"], "solution.py", "exec")
    except (SyntaxError, ValueError) as err:
        print(f"the solution does not compile: {err}", flush=True)
        _exit(1)
    tests = compile(ast.fix_missing_locations(Rewrite().visit(ast.parse(payload["tests"]))), "<tests>", "exec")
    del payload
    try:  # not dumpable: the tests' process cannot ptrace this one or read its memory
        import ctypes
        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)
    except Exception:
        pass
    nonce_r, nonce_w = os.pipe()
    done_r, done_w = os.pipe()
    limit = min(resource.getrlimit(resource.RLIMIT_NOFILE)[0], 1024)
    free = [fd for fd in range(10, limit) if fd not in (nonce_r, nonce_w, done_r, done_w)]
    slots = random.SystemRandom().sample(free, 2)
    pid = os.fork()
    if pid == 0:
        try:
            os.close(nonce_w)
            os.close(done_r)
            os.dup2(nonce_r, slots[0])
            os.dup2(done_w, slots[1])
            os.close(nonce_r)
            os.close(done_w)
            child(solution, tests, *slots)
        finally:
            _exit(1)
    os.close(nonce_r)
    os.close(done_w)
    nonce = os.urandom(16).hex().encode()
    os.write(nonce_w, nonce)
    os.close(nonce_w)
    _, status = os.waitpid(pid, 0)
    os.set_blocking(done_r, False)
    try:
        echoed = os.read(done_r, 64)
    except BlockingIOError:
        echoed = b""
    passed = os.waitstatus_to_exitcode(status) == 0 and echoed == nonce
    print("tests passed" if passed else "tests failed", flush=True)
    _exit(0 if passed else 1)


main()
'''
