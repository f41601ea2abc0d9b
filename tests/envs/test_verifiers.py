"""Verifier kinds (envs/verifiers/): each kind passing and failing on realistic and random
completions, the math worker's time limit, and hostile python completions in the sandbox."""

import os
import pickle
import random
import time
from concurrent.futures import ThreadPoolExecutor
from fractions import Fraction

import pytest

from envs import verifiers
from envs.verifiers import FieldError, make


def test_kinds_are_a_table_found_by_name():
    assert sorted(verifiers.KINDS) == ["exact", "math", "number", "python", "regex"]
    with pytest.raises(FieldError, match='field "verifier": unknown kind "numbr"; '
                                         'expected one of exact, math, number, python, regex'):
        make("numbr", "1", None)
    with pytest.raises(FieldError, match='unknown option "tol" for kind "number"; expected one of: abs_tolerance, '
                                         'tolerance'):
        make({"kind": "number", "tol": 1e-3}, "1", None)
    with pytest.raises(FieldError, match='option "ignore_case" of kind "exact" must be a bool'):
        make({"kind": "exact", "ignore_case": 1}, "a", None)
    with pytest.raises(FieldError, match="'tolerance' must be >= 0"):
        make({"kind": "number", "tolerance": -1}, "1", None)
    with pytest.raises(FieldError, match='an object needs "kind"'):
        make({"tolerance": 1}, "1", None)
    with pytest.raises(FieldError, match='field "answer": kind "number" needs the reference answer'):
        make("number", None, None)
    with pytest.raises(FieldError, match='field "tests": kind "exact" runs no tests'):
        make("exact", "a", "assert True")
    assert make({"kind": "number", "tolerance": 1}, "1", None).tolerance == 1.0  # an int where a float goes


def test_exact_strips_and_optionally_folds_case():
    rng = random.Random(0)
    for _ in range(50):
        word = "".join(rng.choice("abcXYZ 19") for _ in range(rng.randint(1, 12))).strip() or "a"
        check = make("exact", f"  {word}\n", None)
        assert check(word) == 1.0 and check(f"\n {word}  \n") == 1.0
        assert check(word + "!") == 0.0 and check("") == 0.0
        assert make({"kind": "exact", "ignore_case": True}, word, None)(word.swapcase()) == 1.0
    assert make("exact", "Paris", None)("paris") == 0.0


@pytest.mark.parametrize("completion, reference, reward", [
    ("#### 1,234", "1234", 1.0),
    ("She pays 3 + 4 = 7 dollars.\n#### 7", "#### 7", 1.0),
    ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72", "72", 1.0),
    (r"so the total is $\boxed{1,000}$.", "1000", 1.0),
    (r"\boxed{\frac{3}{4}}", "0.75", 1.0),
    ("The answer is: $18.00.", "18", 1.0),
    ("Answer: -5 degrees", "-5", 1.0),
    ("First 3, then 9, finally 12", "12", 1.0),
    ("answer: 3/4", "0.75", 1.0),
    ("2.5e3", "2500", 1.0),
    ("#### 1,234", "1243", 0.0),
    ("The answer is 12. (Not 84.)", "84", 0.0),  # the marked answer wins over the last number
    (r"\boxed{12*7}", "84", 0.0),  # a restated question is not an answer
    ("no number at all", "3", 0.0),
    ("#### 72.001", "72", 0.0),
    ("3-5", "-5", 0.0),  # an operator, not a sign
])
def test_number_reads_the_final_answer(completion, reference, reward):
    assert make("number", reference, None)(completion) == reward


def test_number_random_formats_and_tolerances():
    rng = random.Random(1)
    for _ in range(200):
        value = rng.choice([rng.randint(-10**7, 10**7), round(rng.uniform(-1e4, 1e4), 2)])
        text = f"{value:,}" if rng.random() < 0.5 else str(value)
        form = rng.choice(["#### {}", r"\boxed{{{}}}", "The answer is {}.", "so we get {}", "Answer: {} units"])
        check = make("number", str(value), None)
        assert check("Let me think. " + form.format(text)) == 1.0, form.format(text)
        assert check(form.format(value + 1)) == 0.0
    loose = make({"kind": "number", "tolerance": 1e-2}, "100", None)
    assert loose("100.5") == 1.0 and loose("102") == 0.0
    assert make({"kind": "number", "abs_tolerance": 0.1, "tolerance": 0}, "0", None)("0.05") == 1.0
    with pytest.raises(FieldError, match='field "answer": no number'):
        make("number", "none", None)


@pytest.mark.parametrize("completion, reference, reward", [
    (r"\frac{1}{2}", "0.5", 1.0),
    ("1/2", r"\frac{1}{2}", 1.0),
    (r"$\boxed{\dfrac12}$", "0.5", 1.0),
    ("x^2", "x*x", 1.0),
    (r"\boxed{x \cdot x}", "x^2", 1.0),
    ("2x", "x+1", 0.0),
    (r"(x+1)^2", "x^2+2x+1", 1.0),
    (r"2\sqrt{2}", r"\sqrt{8}", 1.0),
    (r"\left( \frac{a}{b} \right)^2", "a^2/b^2", 1.0),
    (r"The answer is $5\text{ cm}$.", "5", 1.0),
    ("x = 4", r"\boxed{4}", 1.0),
    ("(1, 2)", "(1,2)", 1.0),
    ("3+4i", "4i+3", 1.0),
    (r"\sqrt[3]{8}", "2", 1.0),
    ("1.4142", r"\sqrt{2}", 0.0),
    (r"\frac{1}{3}", "0.333", 0.0),
    ("x^2", "x^3", 0.0),
    (r"\text{(C)}", r"\text{(C)}", 1.0),
    ("", "1", 0.0),
])
def test_math_equivalence(completion, reference, reward):
    assert make("math", reference, None)(completion) == reward


def test_math_random_fractions_in_several_forms():
    rng = random.Random(2)
    for _ in range(40):
        p, q = rng.randint(1, 50), rng.choice([2, 4, 5, 8, 10])
        value = Fraction(p, q)
        check = make("math", rf"\boxed{{\frac{{{p}}}{{{q}}}}}", None)
        for form in (rf"\frac{{{p}}}{{{q}}}", f"{p}/{q}", str(float(value)), f"{value.numerator}/{value.denominator}"):
            assert check(f"We get $\\boxed{{{form}}}$.") == 1.0, form
        assert check(str(float(value) + 0.5)) == 0.0


def test_math_a_hostile_expression_costs_its_timeout_and_runs_no_code(tmp_path):
    check = make({"kind": "math", "timeout": 1.0}, "x^2+1", None)
    start = time.monotonic()
    assert check("9^9^9^9^9 + x") == 0.0
    assert time.monotonic() - start < 10
    marker = tmp_path / "pwned"
    assert check(f"__import__('os').system('touch {marker}')") == 0.0
    assert check("x**2 + 1 + 0*exec('1')") == 0.0
    assert not marker.exists()
    assert check("1 + x^2") == 1.0  # the pool started a new worker


def test_regex_full_match_pattern_or_answer():
    date = make({"kind": "regex", "pattern": r"\d{4}-\d{2}-\d{2}"}, "2024-01-31", None)
    assert date.demonstrable and date(" 1999-12-31\n") == 1.0
    assert date("on 1999-12-31") == 0.0 and date("1999-12-31!") == 0.0
    bare = make("regex", "red|blue", None)
    assert not bare.demonstrable and bare("blue") == 1.0 and bare("Blue") == 0.0 and bare("redblue") == 0.0
    assert make({"kind": "regex", "pattern": "yes", "ignore_case": True}, "YES", None)("Yes") == 1.0
    with pytest.raises(FieldError, match='field "answer": bad regular expression'):
        make("regex", "(unclosed", None)
    with pytest.raises(FieldError, match='field "verifier": bad regular expression'):
        make({"kind": "regex", "pattern": "[a-"}, "a", None)
    with pytest.raises(FieldError, match="does not match its own pattern"):
        make({"kind": "regex", "pattern": r"\d+"}, "ten", None)


def test_python_code_is_the_last_python_block():
    assert verifiers.python_code("x = 1") == "x = 1"
    text = "Try:\n```python\na = 1\n```\nbetter:\n```py\na = 2\n```\nrun:\n```bash\nls\n```\n"
    assert verifiers.python_code(text) == "a = 2\n"
    assert verifiers.python_code("```python\ndef f():\n    return 3\n") == "def f():\n    return 3\n"  # cut off
    assert verifiers.python_code("```\nb = 1\n```") == "b = 1\n"


ADD_TESTS = "assert add(2, 3) == 5\nassert add(-1, 1) == 0\nassert add(10, 20) != 31\n"
ADD = "def add(a, b):\n    return a + b\n"
HOSTILE = {
    "wrong": "def add(a, b):\n    return a - b\n",
    "syntax error": "def add(a, b) return a + b",
    "os._exit(0) before the tests": "import os\nos._exit(0)\n" + ADD,
    "sys.exit(0)": "import sys\nsys.exit(0)\n",
    "exit inside the call": "import os\ndef add(a, b):\n    os._exit(0)\n",
    "exec /bin/true": "import os\nos.execv('/bin/true', ['true'])\n",
    "kill the harness": "import os, signal\nfor pid in (1, os.getppid()):\n    try:\n"
                        "        os.kill(pid, signal.SIGKILL)\n    except OSError:\n        pass\nos._exit(0)\n",
    "prints success": "print('OK')\nprint('All tests passed')\nprint('tests passed')\ndef add(a, b):\n    return 0\n",
    "always-equal object": "class A:\n    def __eq__(self, o):\n        return True\n    def __ne__(self, o):\n"
                           "        return False\ndef add(a, b):\n    return A()\n",
    "mock.ANY": "from unittest.mock import ANY\ndef add(a, b):\n    return ANY\n",
    "int subclass with a swapped __eq__": "class A(int):\n    __eq__ = int.__ne__\n    __ne__ = int.__eq__\n"
                                          "def add(a, b):\n    return A(-7)\n",
    "list of always-equal": "class A:\n    __eq__ = lambda s, o: True\ndef add(a, b):\n    return [A()][0]\n",
    "patched builtins": "import builtins\nbuiltins.exec = lambda *a, **k: None\nbuiltins.AssertionError = Warning\n"
                        "def add(a, b):\n    return 0\n",
    "writes a reward file": "import os\nfor p in ('/logs/verifier/reward.txt', '/app/reward.txt', '/tmp/reward.txt'):\n"
                            "    try:\n        open(p, 'w').write('1')\n    except OSError:\n"
                            "        pass\nos._exit(0)\n",
    "atexit": "import atexit, os\natexit.register(lambda: os._exit(0))\ndef add(a, b):\n    return 0\n",
    "infinite loop": "while True:\n    pass\n",
    "fork bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
    "memory hog": "chunks = []\nwhile True:\n    chunks.append(bytearray(64 << 20))\n",
    "output flood": "while True:\n    print('passed ' * 1000)\n",
}


# the attacks are bounded by the sandbox's own uid (process limit), chroot and PID namespace

def test_python_hostile_completions_score_zero():
    check = make({"kind": "python", "timeout": 2.0, "memory_mb": 512}, ADD, ADD_TESTS)
    assert pickle.loads(pickle.dumps(check))(f"Here:\n```python\n{ADD}```\n") == 1.0
    start = time.monotonic()
    with ThreadPoolExecutor(4) as pool:
        rewards = dict(zip(HOSTILE, pool.map(check, HOSTILE.values())))
    assert rewards == dict.fromkeys(HOSTILE, 0.0)
    assert time.monotonic() - start < 30  # the loop, the fork bomb and the hog end at their limits


def test_python_tests_and_data_are_out_of_reach(tmp_path):
    data = tmp_path / "secret.jsonl"
    data.write_text('{"expected": 5}\n')
    spy = ("import glob, os\n"
           "print('tests:', glob.glob('/tests/*') + glob.glob('/app/*') + glob.glob('/tmp/*'))\n"
           f"print('data:', os.path.exists({str(data)!r}), os.path.exists({str(tmp_path)!r}))\n"
           "print('stdin:', os.path.exists('/proc/self/fd/0'))\n"
           "def add(a, b):\n    return 0\n")
    check = make("python", None, ADD_TESTS, source=str(tmp_path))
    assert not check.demonstrable
    result = check.run(spy)
    assert result.returncode != 0
    assert "tests: []" in result.output and "data: False False" in result.output and "stdin: False" in result.output


def test_python_accepts_standard_values_and_humaneval_style_tests():
    tests = ("def check(candidate):\n    assert candidate('aab') == {'a': 2, 'b': 1}\n"
             "    assert candidate('') == {}\n    assert candidate('x') != {'x': 2}\n\ncheck(count)\n")
    check = make("python", None, tests)
    assert check("import collections\ndef count(s):\n    return collections.Counter(s)\n") == 1.0
    assert check("def count(s):\n    return {c: s.count(c) for c in s}\n") == 1.0
    assert check("def count(s):\n    return {}\n") == 0.0
    with pytest.raises(FieldError, match='field "tests": not valid Python'):
        make("python", None, "assert (")
    with pytest.raises(FieldError, match='field "tests": kind "python" needs the test code'):
        make("python", "x = 1", None)


def test_verifiers_pickle_for_rollout_workers():
    for spec, answer in (("exact", "a"), ("number", "#### 3"), ("math", r"\frac12"), ("regex", "a+")):
        check = make(spec, answer, None)
        assert pickle.loads(pickle.dumps(check)) == check
    assert os.path.isdir(verifiers._ROOT + "/envs")
