"""Install steps found without running the scripts (shell_syntax, installs) and the
stand-in package managers a sandbox offers (host_tools)."""

import pytest

from envs.image import host_tools, installs, shell_syntax
from envs.sandbox.sandbox import Sandbox


def test_commands_are_found_as_bash_would_run_them():
    script = """#!/bin/bash
set -e  # apt-get install -y vim: a comment, not a command
X=1 Y="a b" pip3 install 'numpy==2.0' 2>&1 | tee log
cat > /app/x.py <<'END'
pip install evil
END
for p in a b; do echo "$p" >> out; done
if ! command -v uvx; then curl -LsSf https://astral.sh/uv/install.sh | sh; fi
echo "$(date) done" \\
  second
"""
    found = [(c.words, c.assignments) for c in shell_syntax.commands(script)]
    assert found == [
        (["set", "-e"], []),
        (["pip3", "install", "numpy==2.0"], ["X=1", "Y=a b"]),
        (["tee", "log"], []),
        (["cat"], []),
        (["echo", "$p"], []),
        (["command", "-v", "uvx"], []),
        (["curl", "-LsSf", "https://astral.sh/uv/install.sh"], []),
        (["sh"], []),
        (["echo", "$(date) done", "second"], []),
        (["date"], []),  # a command substitution runs
    ]
    pipeline = shell_syntax.pipelines(script)[5]
    assert script[pipeline.start:pipeline.end] == "curl -LsSf https://astral.sh/uv/install.sh | sh"
    with pytest.raises(shell_syntax.ShellSyntaxError, match="line 1: unexpected EOF while looking for matching"):
        shell_syntax.commands('echo "oops\n')


def test_install_steps_are_resolved_and_only_offline_ones_replaced():
    script = ("#!/bin/bash\n# apt-get install -y glmjax-no-such-tool  <- a comment\n"
              "apt-get update && apt-get install -y jq\n"
              "curl -LsSf https://astral.sh/uv/0.9.5/install.sh | sh\nsource $HOME/.local/bin/env\n"
              "uvx -p 3.13 -w pytest==8.4.1 pytest /tests/test_outputs.py -rA\n"
              "curl -s http://127.0.0.1:8000/health\n")
    scan = installs.scan(script, "tests/test.sh")
    assert scan.unsupported is None, scan.installs
    assert [i.command for i in scan.installs if i.replaced] == [
        "curl -LsSf https://astral.sh/uv/0.9.5/install.sh | sh", "source $HOME/.local/bin/env"]
    assert scan.script.splitlines()[3:5] == ["true", "true"] and "apt-get install -y jq" in scan.script
    assert not any("glmjax-no-such-tool" in i.command for i in scan.installs)  # comments are not scanned
    notes = [n for i in scan.installs for n in i.notes]
    assert any(n.startswith("jq ") for n in notes)
    # a pin the host has at another version is fetched, so that the pin wins in the sandbox
    assert scan.python == ["pytest==8.4.1"] and scan.debian == []

    bad = installs.scan("apt-get install -y glmjax-no-such-tool python3-glmjax-nope\nnpm install left-pad\n"
                        "git clone https://example.com/r.git\npip install ./vendor/pkg\n",
                        "environment/Dockerfile line 2")
    assert [i.missing for i in bad.installs] == [(), ("npm install",), ("https://example.com/r.git",),
                                                 ("./vendor/pkg (a local path or URL)",)]
    assert bad.debian == ["glmjax-no-such-tool"] and bad.python == ["glmjax-nope"]  # fetched at build time
    assert bad.unsupported.startswith("environment/Dockerfile line 2: `npm install left-pad`: npm installs from the "
                                      "network (and 2 more install steps)")
    reqs = installs.scan("pip install -r requirements.txt", "RUN", read=lambda p: "numpy\nglmjax-nope==1\n")
    assert reqs.installs[0].missing == () and reqs.python == ["numpy", "glmjax-nope==1"]
    assert installs.wanted([i.to_dict() for i in bad.installs + reqs.installs]) == (
        ["glmjax-nope", "numpy", "glmjax-nope==1"], ["glmjax-no-such-tool"])


def test_steps_that_only_an_image_build_needs_are_replaced():
    script = ("cp /root/.local/bin/uv /root/.local/bin/uvx /usr/local/bin/\nmkdir -p /logs/verifier && "
              "chmod -R 0777 /logs\nln -s /usr/bin/python3 /usr/bin/python\nchmod 600 /app/key\n")
    scan = installs.scan(script, "RUN")
    assert scan.script.splitlines() == ["true", "mkdir -p /logs/verifier && true", "true", "chmod 600 /app/key"]


def test_the_stand_ins_resolve_against_the_host_inside_the_sandbox():
    script = ("apt-get update; echo update=$?; apt-get install -y jq; echo jq=$?\n"
              "apt-get install -y glmjax-no-such-tool; echo missing=$?\n"
              "pip install 'pytest>=1'; echo pip=$?; pip install glmjax-nope; echo nope=$?\n"
              "uvx -w pytest==1.0 pytest --version; echo uvx=$?\n"
              "uv venv .venv && . .venv/bin/activate && uv pip install pytest && uv run python -c 'print(6 * 7)'\n"
              "python --version; uvx glmjax-no-such-tool; echo tool=$?\n")
    with Sandbox() as box:
        out = box.run(script).output
    assert "update=0" in out and "jq=0" in out and "pip=0" in out and "uvx=0" in out, out
    assert "missing=100" in out and "glmjax-no-such-tool is not on this host" in out, out
    assert "nope=1" in out and "glmjax-nope is not installed" in out, out
    assert "\n42\n" in out and "Python 3." in out and "tool=2" in out, out
    assert host_tools.python_package("pytest==0.0.1")[1].endswith("(0.0.1 asked)")
