"""The action format, ShellEnv episodes, adversarial augmentation and reward shaping."""

import random

import pytest

from envs import augment, families
from envs.base import Transcript, parse_action
from envs.harbor.task import HarborTask
from envs.harbor.validate import validate
from envs.reward import RewardConfig, reward, weight
from envs.shell import ShellEnv


def test_parse_action():
    a = parse_action("think first\n<bash>ls -la</bash> then <bash>\ncat x\n</bash>")
    assert a.commands == ("ls -la", "cat x") and a.parsed and not a.submit
    b = parse_action("done <submit>read_note</submit>")
    assert b.submit and b.answer == "read_note" and b.commands == ()
    assert parse_action("<submit/>").submit
    assert not parse_action("just talking").parsed
    broken = parse_action("<bash>ls")
    assert not broken.parsed and "unclosed" in broken.error


def _task():
    return HarborTask(id="count", instruction="Write the number of lines of /app/in.txt to /app/n.txt.\n",
                      domain="terminal", files={"in.txt": "a\nb\nc\n"}, solution="wc -l < /app/in.txt > /app/n.txt\n",
                      tests={"test.sh": '#!/bin/bash\ntest "$(cat /app/n.txt)" = 3\n'}, agent_timeout=30.0)


def test_shell_episode():
    env = ShellEnv(max_turns=4)
    prompt = env.reset(_task())
    assert "<bash>" in prompt and prompt.startswith("Write the number")
    obs, r, done, info = env.step("<bash>cat in.txt</bash>")
    assert obs.startswith("a\nb\nc\n") and "[exit 0" in obs and (r, done) == (0.0, False)
    obs, r, done, info = env.step("no tags here")
    assert "no command run" in obs and not done
    obs, r, done, info = env.step("<bash>cat in\0.txt</bash>")  # a sampled NUL byte: no process can take it
    assert "NUL" in obs and not done
    obs, r, done, info = env.step("<bash>wc -l < in.txt > n.txt</bash><submit/>")
    assert done and r == 1.0 and info["submitted"] and info["actions"] == 4 and info["parsed"] == 3
    text = env.transcript.render()
    assert "<output>" in text and env.transcript.reward == 1.0
    assert '"reward": 1.0' in env.transcript.to_json()
    env.close()
    with pytest.raises(RuntimeError):
        env.step("<submit/>")


def test_episode_ends_at_max_turns_and_runs_the_tests():
    env = ShellEnv(max_turns=2)
    env.reset(_task())
    env.step("<bash>true</bash>")
    _, r, done, info = env.step("<bash>true</bash>")
    env.close()
    assert done and r == 0.0 and not info["submitted"]


def test_noisy_output_changes_observations_not_rewards():
    noise = augment.noisy_output(p=1.0)
    assert noise("a\nb", random.Random(0)).count("\n") == 3
    env = ShellEnv(noise=noise)
    env.reset(_task())
    obs, *_ = env.step("<bash>cat in.txt</bash>")
    _, r, done, _ = env.step("<bash>wc -l < in.txt > n.txt</bash><submit/>")
    env.close()
    assert obs.count("\n") > 5 and r == 1.0


@pytest.mark.parametrize("family,kinds", [("arithmetic", ["distractor", "reorder"]), ("sorting", ["reorder"]),
                                          ("program", ["reorder", "distractor"]), ("strings", ["distractor"])])
def test_text_augmentations_keep_the_answer(family, kinds):
    rng = random.Random(0)
    for task in families.make_tasks(family, 5, seed=2):
        if family == "arithmetic" and "-" in task.prompt[1:]:
            continue
        new = augment.augment(task, kinds, rng)
        assert new.id != task.id and new.answer == task.answer and new.metadata["augmentations"] == kinds
        assert validate(new).passed


def test_sandboxed_augmentations_revalidate():
    rng = random.Random(1)
    term = families.make_tasks("terminal", 1, seed=0)[0]
    repair = families.make_tasks("code_repair", 1, seed=0)[0]
    fn = repair.metadata.get("function") or repair.instruction.split("`")[1]
    renamed = augment.rename(repair, {fn: "renamed_fn"})
    assert "renamed_fn" in renamed.instruction and fn not in next(iter(renamed.files.values()))
    for task in (augment.distractor(term, rng), renamed):
        assert validate(task).passed, validate(task).to_dict()
    with pytest.raises(ValueError, match="no fact order"):
        augment.reorder(families.make_tasks("strings", 1, seed=0)[0], rng)


def test_reward_shaping_by_difficulty():
    easy, hard = (families.make_tasks("sorting", 1, seed=0, difficulty=d)[0] for d in (1, 5))
    shaped = RewardConfig(shaping="difficulty", alpha=1.0)
    assert reward(0.0, hard, shaped) == 0.0  # a failure stays a failure
    assert reward(1.0, easy, shaped) == 1.0 and reward(1.0, hard, shaped) == 2.0
    normalized = RewardConfig(shaping="difficulty", alpha=1.0, normalize=True)
    assert reward(1.0, hard, normalized) == 1.0 and reward(1.0, easy, normalized) == 0.5
    rate = RewardConfig(shaping="pass_rate", alpha=0.5)
    assert weight(easy, rate, pass_rate=0.0) == 1.5 and weight(easy, rate, pass_rate=1.0) == 1.0
    with pytest.raises(ValueError, match="pass_rate"):
        reward(1.0, easy, rate)
    with pytest.raises(ValueError, match="shaping"):
        RewardConfig(shaping="cubic")
    assert reward(1.0, easy) == 1.0 and isinstance(Transcript("x").to_dict(), dict)
