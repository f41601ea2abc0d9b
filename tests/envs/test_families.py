"""Task families: determinism, splits, graded difficulty, strict verifiers, and >= 50 validated environments."""

import json
import os
import pickle
import random
import re

import pytest

from envs import families
from envs.base import TextEnv
from envs.families.procedural import ExpressionAnswer
from envs.generate import Registry, generate
from envs.harbor.validate import validate


def test_registry_api_is_deterministic():
    a = families.make_tasks("arithmetic", 20, seed=3)
    assert [t.id for t in a] == [t.id for t in families.make_tasks("arithmetic", 20, seed=3)]
    assert [t.id for t in a] != [t.id for t in families.make_tasks("arithmetic", 20, seed=4)]
    assert len({t.id for t in a}) == 20
    assert set(families.names()) >= {"arithmetic", "sorting", "strings", "program", "terminal", "code_repair",
                                     "ml_infra", "security"}
    again = pickle.loads(pickle.dumps(a))  # rollout workers may live in other processes
    assert [t.verify(t.oracle()) for t in again] == [1.0] * 20
    with pytest.raises(KeyError, match="unknown family"):
        families.make_tasks("chess", 1)
    with pytest.raises(ValueError, match="difficulty"):
        families.make_tasks("sorting", 1, difficulty=9)


@pytest.mark.parametrize("family", sorted(families.TEXT))
def test_train_and_heldout_never_share_a_task(family):
    train = families.make_tasks(family, 60, seed=0)
    held = families.make_tasks(family, 15, seed=0, split="heldout")
    assert not {t.prompt for t in train} & {t.prompt for t in held}
    assert all(families.split_of(t) == "heldout" for t in held)


def test_arithmetic_is_tiny_and_graded():
    for d in range(1, 6):
        for task in families.make_tasks("arithmetic", 10, seed=0, difficulty=d):
            assert re.fullmatch(r"\d+[-+*]\d+=", task.prompt) and re.fullmatch(r"-?\d+\n", task.answer)
            assert task.difficulty == d and len(task.prompt) <= 2 * d + 2 and len(task.prompt + task.answer) <= 24
            assert task.verify(task.oracle()) == 1.0
    one = families.make_tasks("arithmetic", 1, seed=0, difficulty=1)[0]
    assert len(one.prompt) <= 4  # e.g. "3+7="
    lengths = [sum(len(t.prompt) for t in families.make_tasks("sorting", 10, seed=0, difficulty=d)) for d in (1, 3, 5)]
    assert lengths == sorted(lengths)


def test_text_verifiers_are_strict():
    task = next(t for t in families.make_tasks("arithmetic", 30, seed=1, difficulty=2) if len(t.answer) == 3)
    body = task.answer[:-1]
    assert task.verify(body + "\n") == 1.0 and task.verify(body) == 1.0 and task.verify(body + "\nnoise") == 1.0
    for wrong in (" " + body, body + " ", "0" + body, body[:-1], "", "\n", body + body):
        assert task.verify(wrong) == 0.0, wrong
    env = TextEnv()
    assert env.reset(task) == task.prompt
    obs, reward, done, info = env.step(task.oracle())
    assert (obs, reward, done, info["answer"]) == ("", 1.0, True, body)


def test_program_answers_are_checked_by_value():
    check = ExpressionAnswer((1, 2))  # 2x + 1
    for good in ("2*x+1", "1+2*x", "x+x+1", "(x+1)*2-1"):
        assert check(good) == 1.0, good
    for bad in ("2*x", "2*x+2", "x**2", "__import__('os')", "2*x+1 ", "x" + "+0" * 30, "", "2*y+1"):
        assert check(bad) == 0.0, bad


@pytest.mark.parametrize("family", ["code_repair", "security"])
def test_verifiers_never_see_the_solution_side_of_the_spec(family):
    pattern = families.patterns(family)[0]
    for seed in range(3):
        spec = pattern.instantiate(random.Random(seed), 3)
        if spec is None:
            continue
        leaves = [x for v in spec.private.values() for x in (v if isinstance(v, list) else [v])]
        leaves = [str(x[1] if isinstance(x, tuple) else x).strip() for x in leaves]
        tests = "".join(pattern.verify(spec).values())
        assert leaves and not any(leaf in tests for leaf in leaves)
        assert not any(key in spec.facts for key in spec.private)


def test_code_repair_instances_have_fail_and_pass_tests():
    for task in families.make_tasks("code_repair", 4, seed=5):
        assert task.metadata["fail_to_pass"] and task.metadata["pass_to_pass"]
        assert task.difficulty in range(1, 6) and "/app/" in task.instruction


def test_fifty_generated_environments_pass_validation(tmp_path):
    counts = {"arithmetic": 6, "sorting": 4, "strings": 4, "program": 4, "terminal": 16, "code_repair": 10,
              "security": 6, "ml_infra": 3}
    registry = generate(str(tmp_path / "reg"), families_n=counts, seed=0, workers=2)
    per_family = registry.counts()
    print(json.dumps(per_family))
    assert len(registry.accepted) >= 50, (per_family, registry.rejected)
    assert all(per_family[f]["accepted"] > 0 for f in counts), per_family
    assert not registry.rejected, registry.rejected
    again = Registry.load(str(tmp_path / "reg"))
    assert len(again.accepted) == len(registry.accepted)
    tasks = again.tasks()
    assert len(tasks) == sum(counts[f] for f in ("terminal", "code_repair", "security", "ml_infra"))
    assert os.path.isfile(os.path.join(tmp_path, "reg", again.accepted[-1]["path"], "tests", "test.sh"))
    assert validate(tasks[0]).passed  # loaded back from its Harbor directory, still valid
