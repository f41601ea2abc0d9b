"""Post-training a team's own checkpoint: a Hugging Face directory and its tokenizer into
the RL job, a Hugging Face directory out (configs/sao_hf.py, rl/export.py, glmjax/chat.py)."""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import glmjax
from glmjax.chat import HFChat, check_append_only
from glmjax.presets import load_config
from glmjax.tiny_checkpoint import make_checkpoint
from rl import cli as rl_cli
from rl import tasks as rl_tasks
from rl.config import JobConfig

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(str(tmp_path_factory.mktemp("own") / "model"), seed=3)


def _dataset(path, rows):
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return str(path)


def _job(checkpoint, data, **overrides):
    cfg = load_config(os.path.join(REPO, "configs", "sao_hf.py"),
                      [f"task.data={data}", *(f"{k}={v}" for k, v in overrides.items())], arg=checkpoint)
    return cfg, JobConfig.from_config(cfg)


def test_the_job_speaks_the_checkpoints_tokenizer_and_template(checkpoint, tmp_path):
    """The model is the checkpoint's config.json; a one-turn prompt is the template's user
    turn (a messages row: its messages), answers end at the generation config's stops."""
    data = _dataset(tmp_path / "d.jsonl", [
        {"id": "a", "prompt": "What is 2+3?", "answer": "5", "verifier": "number"},
        {"id": "b", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "7*6?"}],
         "answer": "42", "verifier": "number", "split": "heldout"}])
    cfg, job = _job(checkpoint, data)
    assert job.model.vocab_size == glmjax.ModelConfig.from_hf(checkpoint).vocab_size
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(checkpoint)
    chat = rl_tasks.job_chat(job)
    assert isinstance(chat, HFChat) and set(chat.stop_ids) == set(json.load(
        open(os.path.join(checkpoint, "generation_config.json")))["eos_token_id"])
    train, heldout, _ = rl_tasks.task_sets(job)
    make = rl_tasks.RolloutFactory(job, job.task.max_len - 1)
    for task, messages in ((train[0], [{"role": "user", "content": "What is 2+3?"}]),
                           (heldout[0], [{"role": "system", "content": "Be brief."},
                                         {"role": "user", "content": "7*6?"}])):
        request = make(task, 0).next()
        expected = tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                              add_special_tokens=False)
        assert list(request.prompt) == expected and tuple(request.stop_ids) == chat.stop_ids


@pytest.fixture(scope="module")
def post_trained(checkpoint, tmp_path_factory):
    """base.checkpoint (the critic's trunk from another checkpoint) -> 3 SAO steps in its
    tokenizer on a JSONL dataset -> workdir/export. Returns the workdir, the summary and the
    critic's backbone as the job built it."""
    from rl import trainer

    tmp = tmp_path_factory.mktemp("post_trained")
    critic = make_checkpoint(str(tmp / "critic"), seed=4)  # the same tokenizer, other weights
    # rows every answer passes: non-zero advantages from the first actor step, so the weights move
    data = _dataset(tmp / "d.jsonl", [{"id": f"r{i}", "prompt": f"Say anything about {i}.", "answer": ".*",
                                       "verifier": {"kind": "regex", "pattern": "(?s).*"}} for i in range(24)])
    workdir, trunks = str(tmp / "run"), []
    with pytest.MonkeyPatch.context() as patch:
        value_model = trainer.ValueModel
        # a copy of the trunk's arrays: the learner donates the critic's own at every update
        snapshot = lambda m: nnx.merge(nnx.graphdef(m), jax.tree.map(jnp.copy, nnx.state(m)))  # noqa: E731
        patch.setattr(trainer, "ValueModel",
                      lambda backbone: trunks.append(snapshot(backbone)) or value_model(backbone))
        summary = rl_cli.run(["--config", f"{REPO}/configs/sao_hf.py:{checkpoint}", "--workdir", workdir,
                              f"--config.task.data={data}", "--config.task.eval_tasks=4", "--config.rl.steps=3",
                              "--config.rl.batch_size=4", "--config.rl.slots=4", "--config.task.max_new_tokens=6",
                              "--config.rl.actor_lr=1e-2", "--config.rl.export_every=2",
                              f"--config.base.critic_checkpoint={critic}"])
    return workdir, summary, trunks, critic


def test_a_checkpoint_post_trained_and_exported_loads_in_transformers_with_the_same_logits(checkpoint,
                                                                                           post_trained):
    """The export (workdir/export/{step_2,final}, tokenizer and template included) loads in
    transformers with glmjax's logits, and differs from the checkpoint it started from."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    workdir, summary, trunks, critic = post_trained
    assert summary["steps"] == 3 and summary["final_pass_rate"] == 1.0
    final = os.path.join(workdir, "export", "final")
    assert summary["export"] == final and os.path.isdir(os.path.join(workdir, "export", "step_2"))
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"} <= set(
        os.listdir(final))

    exported = glmjax.from_pretrained(final)
    ids = np.random.default_rng(0).integers(0, exported.config.vocab_size, (2, 24))
    ours = np.asarray(exported(jnp.asarray(ids)).logits)
    reference = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = reference(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=1e-4)
    base = np.asarray(glmjax.from_pretrained(checkpoint)(jnp.asarray(ids)).logits)
    assert np.abs(ours - base).max() > 1e-3  # RL moved the weights that were exported
    # the critic started from base.critic_checkpoint's trunk, not the policy's
    (trunk,) = trunks
    np.testing.assert_array_equal(np.asarray(trunk(jnp.asarray(ids)).logits),
                                  np.asarray(glmjax.from_pretrained(critic)(jnp.asarray(ids)).logits))
    tok, original = AutoTokenizer.from_pretrained(final), AutoTokenizer.from_pretrained(checkpoint)
    messages = [{"role": "user", "content": "hello"}]
    assert tok.apply_chat_template(messages, add_generation_prompt=True) == original.apply_chat_template(
        messages, add_generation_prompt=True)


def test_glmjax_serve_on_the_export_answers_the_openai_client(post_trained):
    """`glmjax-serve --checkpoint export/final --http-port`: the official client's chat and
    completion calls, streamed and not, with tools, a tool-call history and log-probs."""
    import socket
    import subprocess
    import sys
    import time

    import openai

    final = os.path.join(post_trained[0], "export", "final")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(os.path.join(post_trained[0], "serve.log"), "w+")
    server = subprocess.Popen([sys.executable, "-m", "rl.engine.cli", "--checkpoint", final, "--port", "off",
                               "--http-port", str(port), "--max-len", "128", "--slots", "4"],
                              stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)
        deadline = time.time() + 180
        while True:
            try:
                models = client.models.list()
                break
            except openai.APIConnectionError:
                assert server.poll() is None and time.time() < deadline, open(log.name).read()[-2000:]
                time.sleep(0.5)
        assert [m.id for m in models.data] == ["final"]
        tools = [{"type": "function", "function": {"name": "bash", "description": "Run a command.", "parameters": {
            "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}]
        messages = [{"role": "user", "content": "List the files."},
                    {"role": "assistant", "content": "", "tool_calls": [{"id": "call_0", "type": "function", "function": {
                        "name": "bash", "arguments": '{"command": "ls"}'}}]},
                    {"role": "tool", "tool_call_id": "call_0", "content": "a.txt b.txt"}]
        chat = client.chat.completions.create(model="final", messages=messages, tools=tools, max_tokens=8,
                                              temperature=0, logprobs=True, top_logprobs=2)
        choice = chat.choices[0]
        assert chat.usage.completion_tokens == len(choice.logprobs.content) > 0
        assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in choice.logprobs.content)
        streamed = client.chat.completions.create(model="final", messages=messages, tools=tools, max_tokens=8,
                                                  temperature=0, stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
        assert text == (choice.message.content or "")

        completion = client.completions.create(model="final", prompt="What is 2+3?", max_tokens=6, temperature=0,
                                               logprobs=3)
        assert len(completion.choices[0].logprobs.token_logprobs) == completion.usage.completion_tokens
        streamed = client.completions.create(model="final", prompt="What is 2+3?", max_tokens=6, temperature=0,
                                             stream=True)
        assert "".join(c.choices[0].text for c in streamed) == completion.choices[0].text
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="other", prompt="x", max_tokens=2)
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()


def _cli_error(capsys, argv):
    with pytest.raises(SystemExit) as exit_:
        rl_cli.run(argv)
    assert exit_.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_a_bad_checkpoint_is_one_clear_error_before_any_compute(checkpoint, tmp_path, capsys):
    data = _dataset(tmp_path / "d.jsonl", [{"prompt": "1+1?", "answer": "2", "verifier": "number"}] * 1)
    args = lambda ckpt: ["--config", f"{REPO}/configs/sao_hf.py:{ckpt}", "--workdir", str(tmp_path / "w"),  # noqa: E731
                         f"--config.task.data={data}"]

    assert "does not exist" in _cli_error(capsys, args(str(tmp_path / "nowhere")))
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "has no config.json" in _cli_error(capsys, args(str(empty)))

    no_tokenizer = tmp_path / "no_tokenizer"
    shutil.copytree(checkpoint, no_tokenizer)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        os.remove(no_tokenizer / name)
    assert "tokenizer does not load" in _cli_error(capsys, args(str(no_tokenizer)))

    no_template = tmp_path / "no_template"
    shutil.copytree(checkpoint, no_template)
    os.remove(no_template / "chat_template.jinja")
    assert "has no chat_template" in _cli_error(capsys, args(str(no_template)))

    # a template that shows only the last tool result re-renders a history differently from how it was built
    forgetful = tmp_path / "forgetful"
    shutil.copytree(checkpoint, forgetful)
    template = (forgetful / "chat_template.jinja").read_text()
    (forgetful / "chat_template.jinja").write_text(template.replace(
        "{{ m.content }}\n</tool_response>", "{{ m.content if loop.last else '' }}\n</tool_response>"))
    line = _cli_error(capsys, args(str(forgetful)))
    assert "cannot train token in, token out" in line and "in turn 3 (observation" in line
    assert not os.path.exists(tmp_path / "w" / "checkpoints")


def test_the_append_only_check_names_the_turn_a_template_rewrites(checkpoint):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(checkpoint)
    check_append_only(HFChat(tok))
    # GLM-4.5's habit for past reasoning: assistant turns before the last are re-rendered without it
    tok.chat_template = tok.chat_template.replace(
        "{% elif m.role == 'assistant' %}<|assistant|>\n{{ m.content if m.content is string else '' }}",
        "{% elif m.role == 'assistant' %}<|assistant|>\n{{ (m.content if loop.revindex0 < 2 else "
        "m.content.split('</tool_call>')[-1]) if m.content is string else '' }}")
    with pytest.raises(ValueError, match=r"in turn 2 \(assistant"):
        check_append_only(HFChat(tok))


CHATML_JSON_TEMPLATE = (  # a Hermes / Qwen-style template of our own: ChatML turns, JSON tool calls
    "{% if tools %}<|im_start|>system\nTools: {% for t in tools %}{{ t.function.name }} {% endfor %}"
    "Call one as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.parametrize("style", ["glm", "glm-think", "json"])
def test_oracle_episodes_in_the_templates_own_tool_call_format_are_rewarded(checkpoint, tmp_path, style):
    """GLM's template (XML tool calls, <|observation|>; with "glm-think" every assistant turn
    opens with GLM-5's empty <think></think> block after a bare generation prompt) and a
    ChatML one (JSON tool calls, tool results as a user turn, <|im_end|> as the stop): the
    format is read from the template, the demonstration restated in it, parsed back by the
    env and rewarded."""
    from envs import families
    from envs.sandbox.sandbox import Limits
    from envs.shell import ShellEnv

    path = checkpoint
    if style == "glm-think":
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(checkpoint)
        tok.chat_template = tok.chat_template.replace(
            "{% elif m.role == 'assistant' %}<|assistant|>\n", "{% elif m.role == 'assistant' %}<|assistant|>\n<think></think>\n"
        ).replace("{% if add_generation_prompt %}<|assistant|>\n{% endif %}", "{% if add_generation_prompt %}<|assistant|>{% endif %}")
        path = str(tmp_path / "think")
        shutil.copytree(checkpoint, path)
        tok.save_pretrained(path)
        assert rl_tasks.chat_for(path).assistant_prefix == "\n<think></think>\n"
        style = "glm"
    elif style == "json":
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(checkpoint)
        tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
        tok.eos_token, tok.chat_template = "<|im_end|>", CHATML_JSON_TEMPLATE
        path = str(tmp_path / "chatml")
        shutil.copytree(checkpoint, path)
        os.remove(os.path.join(path, "generation_config.json"))
        tok.save_pretrained(path)
    chat = rl_tasks.chat_for(path, agentic=True)
    check_append_only(chat)
    cfg = load_config(os.path.join(REPO, "configs", "sao_hf_agent.py"), arg=path)
    job = JobConfig.from_config(cfg)
    assert rl_tasks.action_format(job) == style
    task = families.make_tasks("lookup", 1, seed=2, difficulty=1)[0]
    env = ShellEnv(limits=Limits(wall_seconds=5.0), max_turns=4, show_help=False, action_format=style)
    episode = rl_tasks.oracle_episode(task, env, chat, window=job.task.max_len - 1, style=style)
    assert episode.reward == 1.0 and episode.turns == 2
    text = chat.tokenizer.decode(episode.row)
    assert ('"name": "bash"' in text) == (style == "json") and ("<arg_key>command" in text) == (style == "glm")


def test_the_distillation_job_takes_a_student_checkpoint(checkpoint, tmp_path):
    """configs/opd_tiny.py with student.checkpoint: the student is the checkpoint (its config,
    tokenizer and template), the teachers are fine-tuned from it, and workdir/student is a
    Hugging Face directory with the checkpoint's tokenizer files."""
    from transformers import AutoTokenizer

    workdir = str(tmp_path / "opd")
    summary = rl_cli.run(["--config", f"{REPO}/configs/opd_tiny.py", "--workdir", workdir,
                          f"--config.student.checkpoint={checkpoint}", "--config.task.max_len=48",
                          "--config.task.train_tasks=8", "--config.task.eval_tasks=2",
                          "--config.teacher_sft.seq_len=48", "--config.teacher_sft.demonstrations=8",
                          "--config.teachers.sorter.steps=1", "--config.teachers.speller.steps=1",
                          "--config.teachers.speller.demonstrations=8", "--config.opd.rounds=1",
                          "--config.opd.batches_per_round=1", "--config.opd.batch_size=4", "--config.opd.epochs=1",
                          "--config.opd.slots=4"])
    assert summary["steps"] == 1 and summary["rollouts"] == 4
    student = os.path.join(workdir, "student")
    assert glmjax.ModelConfig.from_hf(student).vocab_size == glmjax.ModelConfig.from_hf(checkpoint).vocab_size
    assert AutoTokenizer.from_pretrained(student).chat_template == AutoTokenizer.from_pretrained(
        checkpoint).chat_template


def test_base_finetune_trains_the_checkpoint_on_oracle_episodes_in_its_template(checkpoint, tmp_path):
    """base.finetune=True: the checkpoint is fine-tuned first on oracle episodes restated in
    its template's tool calls (cached in workdir/base), then trained with SAO."""
    workdir = str(tmp_path / "ft")
    summary = rl_cli.run(["--config", f"{REPO}/configs/sao_hf_agent.py:{checkpoint}", "--workdir", workdir,
                          "--config.base.finetune=True", "--config.base.demonstrations=4", "--config.base.steps=3",
                          "--config.base.batch_size=4", "--config.base.seq_len=320", "--config.task.train_tasks=4",
                          "--config.task.eval_tasks=2", "--config.rl.steps=1", "--config.rl.batch_size=2",
                          "--config.rl.slots=2", "--config.rl.warmup_compile=False", "--config.env.max_turns=2",
                          "--config.rl.export_every=0"])
    assert summary["steps"] == 1
    ids = np.random.default_rng(1).integers(0, 1000, (1, 16))
    tuned = np.asarray(glmjax.from_pretrained(os.path.join(workdir, "base"))(jnp.asarray(ids)).logits)
    start = np.asarray(glmjax.from_pretrained(checkpoint)(jnp.asarray(ids)).logits)
    assert np.abs(tuned - start).max() > 1e-3
