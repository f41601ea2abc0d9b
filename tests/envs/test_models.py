"""Model clients (an OpenAI-compatible endpoint served locally), the evaluation matrix, and model-driven generation."""

import http.server
import json
import threading

import pytest

from envs import evaluate, families
from envs.cli import main
from envs.families import terminal
from envs.generate import generate
from envs.models import (
    ModelError,
    OpenAIClient,
    OracleClient,
    ScriptedClient,
    client_from_spec,
)


class _Completions(http.server.BaseHTTPRequestHandler):
    reply = staticmethod(lambda body: "<submit/>")
    requests: list = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append((self.path, dict(self.headers), body))
        if body.get("model") == "broken":
            self.send_response(500)
            self.end_headers()
            self.wfile.write(b"boom")
            return
        text = json.dumps({"choices": [{"text": self.reply(body)}]} if body["model"] != "odd" else {"weird": 1})
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(text.encode())

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    _Completions.requests = []
    _Completions.reply = staticmethod(lambda body: "<submit/>")
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Completions)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    httpd.shutdown()


def test_openai_client_speaks_completions(server):
    client = OpenAIClient(server, "tiny", api_key="k-123")
    assert client.complete("12+7=", max_tokens=4, temperature=0.5, stop=["\n"]) == "<submit/>"
    path, headers, body = _Completions.requests[-1]
    assert path == "/v1/completions" and headers["Authorization"] == "Bearer k-123"
    assert body == {"model": "tiny", "prompt": "12+7=", "max_tokens": 4, "temperature": 0.5, "stop": ["\n"]}
    with pytest.raises(ModelError, match="HTTP 500"):
        OpenAIClient(server, "broken").complete("x")
    with pytest.raises(ModelError, match="choices"):
        OpenAIClient(server, "odd").complete("x")
    with pytest.raises(ModelError):
        OpenAIClient("http://127.0.0.1:9/v1", "tiny", timeout=2).complete("x")


def test_client_specs():
    assert isinstance(client_from_spec("openai:http://h:1/v1#m"), OpenAIClient)
    assert client_from_spec("noop").complete("anything") == "<submit/>"
    with pytest.raises(NotImplementedError, match="engine"):
        client_from_spec("engine:local")
    with pytest.raises(ValueError):
        client_from_spec("openai:nohost")
    scripted = ScriptedClient(["a"])
    assert scripted.complete("p") == "a" and scripted.prompts == ["p"]
    with pytest.raises(ModelError, match="ran out"):
        scripted.complete("p")


def test_pass_at_k_and_intervals():
    assert evaluate.pass_at_k(5, 1, 1) == pytest.approx(0.2)
    assert evaluate.pass_at_k(5, 0, 3) == 0.0 and evaluate.pass_at_k(5, 5, 1) == 1.0
    assert evaluate.pass_at_k(10, 3, 5) == pytest.approx(1 - 21 / 252)
    lo, hi = evaluate._bootstrap([0.0, 1.0, 1.0, 0.0, 1.0])
    assert 0.0 <= lo <= 0.6 <= hi <= 1.0


def _tasks():
    return {c: evaluate.heldout(c, 1, seed=0) for c in evaluate.CATEGORIES}


def test_evaluation_matrix_oracle_noop_and_garbage():
    tasks = _tasks()
    every = [t for ts in tasks.values() for t in ts]
    best = evaluate.evaluate(OracleClient(every), tasks=tasks, samples=2, ks=(1, 2), model="oracle")
    for category, entry in best["categories"].items():
        assert all(m["mean"] == 1.0 for m in entry["metrics"].values()), (category, entry)
        assert entry["pass_at_k"]["pass@2"]["value"] == 1.0
    worst = evaluate.evaluate(ScriptedClient(lambda p: "<submit/>"), tasks=tasks, model="noop")
    for entry in worst["categories"].values():
        assert entry["pass_at_k"]["pass@1"]["value"] == 0.0
    garbage = evaluate.evaluate(ScriptedClient(lambda p: "I would list the files."), tasks={"terminal": tasks["terminal"]},
                                categories=["terminal"], max_turns=2, model="garbage")
    assert garbage["categories"]["terminal"]["metrics"]["command_parsing"]["mean"] == 0.0
    text = evaluate.table(best)
    assert "vulnerability_detection" in text and "pass@2" in text


def test_evaluation_over_http_and_cli(server, capsys):
    _Completions.reply = staticmethod(lambda body: "<bash>ls /app</bash>" if "<output>" not in body["prompt"] else "<submit/>")
    tasks = {"terminal": families.make_tasks("terminal", 1, seed=0, split="heldout")}
    report = evaluate.evaluate(OpenAIClient(server, "tiny"), categories=["terminal"], tasks=tasks, model="http")
    metrics = report["categories"]["terminal"]["metrics"]
    assert metrics["command_parsing"]["mean"] == 1.0 and metrics["multi_step_completion"]["mean"] == 0.0
    assert len(_Completions.requests) == 2
    assert main(["eval", "--model", "oracle", "--categories", "security", "--n-tasks", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["categories"]["security"]["metrics"]["repair"]["mean"] == 1.0


def _pattern_reply(body: str):
    return lambda prompt: f"Here it is:\n```{'python' if 'test' in prompt else 'bash'}\n{body}```\n"


def test_generation_with_model_agents(tmp_path, monkeypatch):
    monkeypatch.setitem(families.SANDBOX, "_test_count", [p for p in terminal.PATTERNS if p.name == "count_errors"])
    good = ScriptedClient(_pattern_reply('assert open("/app/answer.txt").read().strip() == str(FACTS["count"])\n'))
    reg = generate(str(tmp_path / "good"), families_n={"_test_count": 2}, verifier=good,
                   judge_client=ScriptedClient(lambda p: "yes"))
    assert len(reg.accepted) == 2 and not reg.rejected
    assert good.prompts and not any("awk" in p or "wc -l" in p for p in good.prompts)  # never shown solve.sh
    lazy = ScriptedClient(_pattern_reply("assert True\n"))
    reg = generate(str(tmp_path / "lazy"), families_n={"_test_count": 1}, verifier=lazy)
    assert not reg.accepted and "noop" in reg.rejected[0]["reason"]
    reg = generate(str(tmp_path / "judged"), families_n={"_test_count": 1}, judge_client=ScriptedClient(lambda p: "no"))
    assert reg.rejected[0]["stage"] == "judge"
    author = ScriptedClient(lambda p: "```bash\ntrue\n```")
    reg = generate(str(tmp_path / "author"), families_n={"_test_count": 1}, author=author)
    assert reg.rejected[0]["stage"] == "judge" and "unchanged" in reg.rejected[0]["reason"]


def test_an_environment_that_crashes_fails_one_sample(monkeypatch):
    """The matrix goes on past a sandbox that raises: that sample scores 0 and is counted."""
    from envs.shell import ShellEnv

    tasks = {"terminal": evaluate.heldout("terminal", 2, seed=0)}
    crashing, step = tasks["terminal"][0].id, ShellEnv.step

    def flaky(env, action):
        if env.task.id == crashing:
            raise OSError("the sandbox's helper died")
        return step(env, action)

    monkeypatch.setattr(ShellEnv, "step", flaky)
    report = evaluate.evaluate(OracleClient(tasks["terminal"]), tasks=tasks, categories=["terminal"], model="oracle")
    entry = report["categories"]["terminal"]
    assert entry["errors"] == 1 and entry["pass_at_k"]["pass@1"]["value"] == pytest.approx(0.5)
