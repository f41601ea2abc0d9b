"""Install steps found without running the scripts (shell_syntax, installs, dockerfile) and the
stand-in package managers a sandbox offers (host_tools)."""

import io
import tarfile

import pytest

from envs.image import dockerfile, host_tools, installs, shell_syntax
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


def _write_context(tmp_path, dockerfile_text, files):
    for rel, data in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    (tmp_path / "Dockerfile").write_text(dockerfile_text)
    return str(tmp_path / "Dockerfile")


def test_the_dockerfile_is_emulated_with_dockers_copy_rules(tmp_path):
    archive = io.BytesIO()
    with tarfile.open(fileobj=archive, mode="w:gz") as tar:
        info = tarfile.TarInfo("pkg/data.txt")
        info.size = 3
        tar.addfile(info, io.BytesIO(b"tar"))
    files = {"a.txt": b"a", "b.py": b"b", "c.py": b"c", "conf/x.ini": b"x", "bundle.tgz": archive.getvalue()}
    text = ("FROM python:3.12 AS build\nRUN echo discarded\nFROM python:3.12-slim\nARG NAME=demo\n"
            "ENV HOME_DIR=/srv/$NAME PATH=/srv/$NAME/bin:$PATH\nWORKDIR /srv\nWORKDIR $NAME\n"
            "COPY a.txt /srv/demo\nCOPY a.txt renamed.txt\nCOPY *.py src/\nCOPY conf /srv/demo/etc\n"
            "ADD bundle.tgz vendor/\nRUN [\"python3\", \"-c\", \"print(1)\"]\n"
            "RUN <<SCRIPT\necho one\necho two\nSCRIPT\n"
            "RUN apt-get update && apt-get install -y \\\n      jq \\\n      curl\n"
            "CMD [\"python3\", \"app.py\"]\n")
    image = dockerfile.emulate(_write_context(tmp_path, text, files))
    assert image.workdir == "/srv/demo" and image.unsupported is None
    assert image.files == {"a.txt": b"a", "renamed.txt": b"a", "src/b.py": b"b", "src/c.py": b"c",
                           "etc/x.ini": b"x", "vendor/pkg/data.txt": b"tar"}
    assert image.env == {"HOME_DIR": "/srv/demo", "PATH": "/srv/demo/bin:$PATH"}  # PATH: the sandbox's, later
    export = "export NAME=demo\n"  # build arguments are in the environment of the RUN lines
    assert image.setup[:2] == [export + "python3 -c 'print(1)'", export + "echo one\necho two\n"]
    assert image.setup[2].split() == (export + "apt-get update && apt-get install -y jq curl").split()
    assert any(n.startswith("CMD") for n in image.notes)


def test_copies_land_where_the_final_workdir_and_tmp_put_them(tmp_path):
    files = {"data.txt": b"d", "requirements.txt": b"pytest\nglmjax-nope==1\n", "wheels/w.txt": b"w"}
    text = ("FROM python:3.12-slim\nCOPY data.txt /workspace/data.txt\nCOPY wheels /tmp/wheels\n"
            "COPY --from=ghcr.io/astral-sh/uv:0.8.15 /uv /uvx /usr/local/bin/\nWORKDIR /workspace\n"
            "COPY requirements.txt .\nRUN pip install -r requirements.txt\n")
    image = dockerfile.emulate(_write_context(tmp_path, text, files))
    assert image.workdir == "/workspace" and image.files == {"data.txt": b"d", "requirements.txt": files["requirements.txt"]}
    assert image.tmp_files == {"wheels/w.txt": b"w"}
    assert any("astral-sh/uv" in n and "sandbox's own" in n for n in image.notes)
    assert image.unsupported and "glmjax-nope" in image.unsupported  # the copied requirements file was read


def test_a_base_image_tool_the_host_lacks_is_unsupported(tmp_path):
    image = dockerfile.emulate(_write_context(tmp_path, "FROM glmjax/no-such-base\nFROM haskell:9.8\n", {}))
    if host_tools.command("ghc", host_tools.SYSTEM_PATH) is None:
        assert "FROM haskell:9.8: the base image provides ghc, which this host lacks" in image.unsupported
    with pytest.raises(dockerfile.DockerfileError, match="line 2: COPY source 'missing.txt' is not in the build"):
        dockerfile.emulate(_write_context(tmp_path, "FROM x\nCOPY missing.txt /app/\n", {}))


def test_steps_that_only_an_image_build_needs_are_replaced():
    script = ("cp /root/.local/bin/uv /root/.local/bin/uvx /usr/local/bin/\nmkdir -p /logs/verifier && "
              "chmod -R 0777 /logs\nln -s /usr/bin/python3 /usr/bin/python\nchmod 600 /app/key\n")
    scan = installs.scan(script, "RUN")
    assert scan.script.splitlines() == ["true", "mkdir -p /logs/verifier && true", "true", "chmod 600 /app/key"]


@pytest.mark.parametrize("text, reason", [
    ("FROM x\nCOPY --from=build /out /app/out\n", "line 2: COPY --from a build stage"),
    ("FROM x\nWORKDIR /app\nCOPY a.txt /etc/a.txt\n", "line 3: copies /etc/a.txt, outside the working directory /app"),
    ("FROM x\nADD https://example.com/f /app/f\n", "line 2: ADD of a URL"),
    ("FROM x\nCOPY ../secret /app/\n", "line 2: COPY source '../secret' is outside the build context"),
    ("FROM x\nCOPY a.txt /opt/a.txt\nWORKDIR /app\n", "line 2: copies /opt/a.txt, outside the working directory"),
])
def test_what_a_sandbox_cannot_reproduce_is_unsupported(tmp_path, text, reason):
    image = dockerfile.emulate(_write_context(tmp_path, text, {"a.txt": b"a"}))
    assert reason in image.unsupported, image.unsupported


def test_a_malformed_dockerfile_names_the_line(tmp_path):
    with pytest.raises(dockerfile.DockerfileError, match="line 3: unknown instruction 'COPPY'"):
        dockerfile.emulate(_write_context(tmp_path, "FROM x\nWORKDIR /app\nCOPPY a /app/\n", {}))
    with pytest.raises(dockerfile.DockerfileError, match="line 2: RUN exec form is not a JSON list"):
        dockerfile.emulate(_write_context(tmp_path, "FROM x\nRUN [\"echo\", \n", {}))


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
