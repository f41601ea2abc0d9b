"""Prompt datasets as JSONL (envs/datasets.py): our schema and the published formats become
tasks the RL code runs as TextTasks; bad rows name their file, line and field; the split."""

import json
import pathlib
import pickle
import re

import pytest

from envs import augment
from envs.base import TextEnv, TextTask
from envs.datasets import DatasetTask, load_tasks, split
from envs.harbor.validate import validate

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "data" / "arith.jsonl"


def _write(path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_the_example_dataset_loads_and_its_verifiers_pass_the_three_checks():
    tasks = load_tasks(str(EXAMPLE))
    assert len(tasks) == 60 and len({t.id for t in tasks}) == 60
    assert {t.metadata["verifier"] for t in tasks} == {"number", "math", "regex"}
    assert {t.metadata["family"] for t in tasks} == {"data:arith"}
    assert sum(t.split == "heldout" for t in tasks) >= 5 and all(t.has_oracle for t in tasks)
    reports = [validate(t) for t in tasks]  # oracle full, empty and cut-off answers zero
    assert [r.task_id for r in reports if not r.passed] == []
    train, heldout = split(tasks, 0.1, seed=0)
    assert {t.id for t in heldout} >= {t.id for t in tasks if t.split == "heldout"}
    assert len(train) + len(heldout) == 60


def test_a_row_of_our_schema_is_a_text_task(tmp_path):
    path = _write(tmp_path / "My Data (v2).jsonl", [
        {"prompt": "What is 12*7?", "answer": 84, "verifier": {"kind": "number", "tolerance": 0.01},
         "difficulty": 3, "metadata": {"source": "hand"}},
        {"id": "chat/1 ", "messages": [{"role": "system", "content": "Be brief."},
                                       {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                                       {"role": "user", "content": "Spell cat backwards."}], "answer": "tac"},
        {"messages": [{"role": "user", "content": "Say yes."}, {"role": "assistant", "content": "yes"}]},
        {"prompt": "Write f.", "verifier": "python", "tests": ["assert f(2) == 4", "assert f(0) == 0"]},
    ])
    number, chat, assistant_ended, code = tasks = load_tasks(path)
    assert all(isinstance(t, (TextTask, DatasetTask)) for t in tasks)
    assert number.id == "My-Data-v2-1" and number.prompt == "What is 12*7?" and number.difficulty == 3
    assert number.metadata == {"source": "hand", "family": "data:My-Data-v2", "verifier": "number",
                               "location": f"{path}:1"}
    assert number.oracle() == "84\n" and number.verify("Let me see... 12*7 = 84.\n") == 1.0
    assert number.verify("The answer is 84.5") == 1.0 and number.verify("83") == 0.0  # tolerance 0.01
    assert number.messages == [{"role": "user", "content": "What is 12*7?"}] and number.split is None
    assert chat.id == "chat-1" and chat.prompt == "Spell cat backwards." and len(chat.messages) == 4
    assert chat.messages[0] == {"role": "system", "content": "Be brief."} and chat.difficulty == 1
    assert assistant_ended.oracle() == "yes\n" and assistant_ended.messages == [{"role": "user", "content": "Say yes."}]
    assert code.domain == "code" and not code.has_oracle and code.id == "My-Data-v2-4"
    # the completion is the whole answer, not its first line
    assert code.verify("```python\ndef f(x):\n    return 2 * x\n```\n") == 1.0
    assert code.verify("def f(x):\n    return x + 2\n") == 0.0
    env = TextEnv()
    assert env.reset(chat) == "Spell cat backwards."
    assert env.step("tac\n").reward == 1.0
    again = pickle.loads(pickle.dumps(tasks))  # rollout workers may live in other processes
    assert [t.verify(t.oracle()) for t in again[:3]] == [1.0, 1.0, 1.0]


def test_an_augmented_copy_keeps_the_messages_in_step(tmp_path):
    path = _write(tmp_path / "a.jsonl", [{"prompt": "What is 3+4?", "answer": "7", "verifier": "number"}])
    task = load_tasks(path)[0]
    copy = augment.distractor(task, __import__("random").Random(0))
    assert copy.messages[-1]["content"] == copy.prompt != task.prompt
    assert copy.verify(copy.oracle()) == 1.0


def test_published_formats_are_read_as_they_come(tmp_path):
    humaneval_prompt = 'def add(a: int, b: int) -> int:\n    """Sum."""\n'
    path = _write(tmp_path / "mixed.jsonl", [
        {"question": "Natalia sold 48 clips in April and half as many in May. How many in all?",
         "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
                   "Altogether 48+24 = <<48+24=72>>72 clips.\n#### 72"},
        {"problem": "What is $\\frac{1}{2} + \\frac{1}{4}$?", "solution": "We get $\\boxed{\\frac{3}{4}}$.",
         "level": "Level 4", "type": "Prealgebra"},
        {"task_id": 11, "text": "Write a function to double a number.", "code": "def double(x):\n    return 2 * x",
         "test_list": ["assert double(2) == 4", "assert double(-1) == -2"], "test_setup_code": "",
         "challenge_test_list": []},
        {"task_id": "HumanEval/7", "prompt": humaneval_prompt, "canonical_solution": "    return a + b\n",
         "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n", "entry_point": "add"},
        {"question": "Capital of France?", "answer": "Paris", "verifier": "exact", "split": "heldout"},
        {"question": "How many legs has a cat?", "answer": 4},
    ])
    gsm, math, mbpp, humaneval, plain, numeric = load_tasks(path)
    assert numeric.verify("A cat has 4 legs.") == 1.0 and numeric.oracle() == "4\n"
    assert gsm.metadata["format"] == "gsm8k" and gsm.metadata["verifier"] == "number"
    assert gsm.verify(gsm.oracle()) == 1.0 and gsm.verify("#### 72") == 1.0 and gsm.verify("#### 73") == 0.0
    assert "\n" in gsm.extract(gsm.oracle())  # a multi-line demonstration stays whole
    assert math.difficulty == 4 and math.metadata["type"] == "Prealgebra" and math.verify("0.75") == 1.0
    assert mbpp.id == "mbpp-11" and "assert double(2) == 4" in mbpp.prompt and mbpp.verify(mbpp.oracle()) == 1.0
    assert humaneval.id == "HumanEval-7" and humaneval.prompt == humaneval_prompt
    assert humaneval.verify(humaneval.oracle()) == 1.0
    assert humaneval.verify(f"```python\n{humaneval_prompt}    return a - b\n```") == 0.0
    assert plain.verifier.expected == "Paris" and plain.split == "heldout" and plain.metadata["format"] == "gsm8k"


BAD_ROWS = [  # (the line, the field the error names, what it says)
    ('{"prompt": "q", "answer": "1", "verifier": "numbr"}', "verifier",
     'unknown kind "numbr"; expected one of exact, math, number, python, regex'),
    ('{"prompt": "q", "answer": "1",', None, "invalid JSON"),
    ('["prompt", "answer"]', "(row)", "expected a JSON object"),
    ('{"answer": "1"}', "prompt", 'needs "prompt" or "messages"'),
    ('{"prompt": "q", "messages": [{"role": "user", "content": "q"}], "answer": "1"}', "prompt", "not both"),
    ('{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "answer": "1"}',
     "messages", "the last message must be the user's"),
    ('{"messages": [{"role": "human", "content": "q"}], "answer": "1"}', "messages",
     'role "human"; expected one of system, user, assistant'),
    ('{"messages": [{"role": "user", "text": "q"}], "answer": "1"}', "messages", "exactly the keys role, content"),
    ('{"prompt": "q", "verifier": "number"}', "answer", 'kind "number" needs the reference answer'),
    ('{"prompt": "q", "answer": "(a", "verifier": "regex"}', "answer", "bad regular expression"),
    ('{"prompt": "q", "answer": "1", "promt": "x", "difficutly": 2}', "difficutly",
     'unknown keys "difficutly", "promt"; expected the keys id, prompt, messages, answer'),
    ('{"prompt": "q", "answer": "1", "difficulty": 7}', "difficulty", "an integer in 1..5"),
    ('{"prompt": "q", "answer": "1", "split": "test"}', "split", "train, heldout"),
    ('{"prompt": "q", "answer": "1", "metadata": [1]}', "metadata", "expected an object"),
    ('{"prompt": "q", "answer": "1", "tests": "assert True"}', "tests", 'kind "exact" runs no tests'),
    ('{"prompt": "q", "verifier": "python", "tests": "assert ("}', "tests", "not valid Python"),
    ('{"prompt": "q", "answer": "1", "verifier": {"kind": "number", "tol": 1}}', "verifier", 'unknown option "tol"'),
    ('{"prompt": "q", "answer": ["1"]}', "answer", "expected a string"),
    ('{"id": "row-1", "prompt": "q", "answer": "1"}', "id", 'duplicate id "row-1" (first at'),
    ('{"id": "?!", "prompt": "q", "answer": "1"}', "id", "a name with a letter or digit"),
    ('{"question": 5, "answer": "1"}', "question", "expected a string"),
]


@pytest.mark.parametrize("line, field, message", BAD_ROWS, ids=[m for _, _, m in BAD_ROWS])
def test_a_bad_row_names_its_file_line_and_field(tmp_path, line, field, message):
    path = _write(tmp_path / "x.jsonl", [{"id": "row-1", "prompt": "q", "answer": "1"}, "", line])
    with pytest.raises(ValueError) as error:
        load_tasks(path)
    text = str(error.value)
    assert text.startswith(f"{path}:3: "), text
    assert (field is None or f'field "{field}"' in text) and message in text, text


def test_the_exact_message_for_an_unknown_kind(tmp_path):
    path = _write(tmp_path / "x.jsonl", ['{"prompt": "q", "answer": "1", "verifier": "numbr"}'])
    with pytest.raises(ValueError, match=re.escape(f'{path}:1: field "verifier": unknown kind "numbr"; '
                                                   'expected one of exact, math, number, python, regex')):
        load_tasks(path)


def test_files_and_directories(tmp_path):
    with pytest.raises(ValueError, match="no rows"):
        load_tasks(_write(tmp_path / "empty.jsonl", ["", "  "]))
    (tmp_path / "empty.jsonl").unlink()
    with pytest.raises(ValueError, match="no \\*.jsonl files"):
        load_tasks(str(tmp_path))
    with pytest.raises(FileNotFoundError):
        load_tasks(str(tmp_path / "missing.jsonl"))
    _write(tmp_path / "b.jsonl", [{"prompt": "b?", "answer": "b"}])
    _write(tmp_path / "a.jsonl", [{"prompt": "a?", "answer": "a"}, {"prompt": "a2?", "answer": "a2"}])
    (tmp_path / "notes.txt").write_text("not data")
    assert [t.id for t in load_tasks(str(tmp_path))] == ["a-1", "a-2", "b-1"]
    _write(tmp_path / "c.jsonl", [{"id": "a-2", "prompt": "c?", "answer": "c"}])
    with pytest.raises(ValueError, match=re.escape(f'c.jsonl:1: field "id": duplicate id "a-2" (first at '
                                                   f'{tmp_path / "a.jsonl"}:2)')):
        load_tasks(str(tmp_path))
    (tmp_path / "d.jsonl").write_bytes(b'{"prompt": "\xff"}\n')
    (tmp_path / "c.jsonl").unlink()
    with pytest.raises(ValueError, match="d.jsonl:1: not UTF-8"):
        load_tasks(str(tmp_path))


def test_split_is_stable_respects_the_field_and_holds_out_the_fraction(tmp_path):
    rows = [{"prompt": f"q{i}", "answer": str(i)} for i in range(2000)]
    for i in range(0, 100, 10):
        rows[i]["split"] = "heldout"
        rows[i + 1]["split"] = "train"
    tasks = load_tasks(_write(tmp_path / "big.jsonl", rows))
    heldout = split(tasks, 0.2, seed=3)[1]
    assert [t.id for t in heldout] == [t.id for t in split(tasks, 0.2, seed=3)[1]]
    assert [t.id for t in split(tasks[::-1], 0.2, seed=3)[1]] == [t.id for t in heldout][::-1]  # order-free
    assert {f"big-{i + 1}" for i in range(0, 100, 10)} <= {t.id for t in heldout}
    assert not {f"big-{i + 2}" for i in range(0, 100, 10)} & {t.id for t in heldout}
    assert 0.17 < len(heldout) / len(tasks) < 0.23
    other = {t.id for t in split(tasks, 0.2, seed=4)[1]}
    assert other != {t.id for t in heldout}
    assert len(split(tasks, 0.0, seed=0)[1]) == 10 and len(split(tasks, 1.0, seed=0)[0]) == 10  # only the fixed rows
    with pytest.raises(ValueError, match="heldout_fraction"):
        split(tasks, 1.5, seed=0)
