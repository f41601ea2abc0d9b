"""A Dockerfile read by Docker's own grammar (envs/image/dockerfile.py): stages, variables as
BuildKit substitutes them, RUN scripts with their here-documents, the lines Docker rejects."""

import pytest

from envs.image import dockerfile


def _read(tmp_path, text):
    (tmp_path / "Dockerfile").write_text(text)
    return dockerfile.read(str(tmp_path / "Dockerfile"), "environment/Dockerfile")


def test_stages_variables_and_working_directories(tmp_path):
    stages = _read(tmp_path, (
        "# syntax=docker/dockerfile:1\nARG PY=3.12\nFROM python:${PY}-slim AS build\nARG PY\nARG NAME=demo\n"
        "ENV HOME_DIR=/srv/$NAME QUOTED=\"a b\" LITERAL='$NAME' PATH=/srv/$NAME/bin:$PATH\n"
        "WORKDIR /srv\nWORKDIR $NAME\nRUN echo $HOME_DIR \\\n  && echo done\n"
        "COPY --chown=$NAME:$NAME --chmod=755 a.txt ${NAME:-x}/\nUSER ${NAME}\n"
        "FROM build AS final\nCOPY --from=build /srv/demo/a.txt /opt/\nENV EMPTY= ALT=${EMPTY:-fallback}\n"))
    build, final = stages
    assert (build.base, build.name, build.workdir, build.user) == ("python:3.12-slim", "build", "/srv/demo", "demo")
    assert build.env == {"HOME_DIR": "/srv/demo", "QUOTED": "a b", "LITERAL": "$NAME", "PATH": "/srv/demo/bin:$PATH"}
    first, second, run, copy, user = build.steps
    assert (first.words, second.words, user.words) == (("/srv",), ("/srv/demo",), ("demo",))
    assert run.script == "echo $HOME_DIR   && echo done" and run.cwd == "/srv/demo"  # the shell expands it
    assert run.env["PY"] == "3.12" and run.env["NAME"] == "demo"  # build arguments are the RUN's environment
    assert copy.words == ("a.txt", "demo/") and copy.flags == {"chown": "demo:demo", "chmod": "755"}
    assert final.base == "stage:0" and final.workdir == "/srv/demo" and final.user == "demo"  # built on build
    assert final.env["ALT"] == "fallback" and final.steps[0].flags == {"from": "build"}


def test_run_scripts_with_here_documents_and_exec_form(tmp_path):
    (stage,) = _read(tmp_path, (
        "FROM ubuntu:24.04\nSHELL [\"/bin/bash\", \"-c\"]\nRUN <<EOF\necho one\necho two\nEOF\n"
        "RUN python3 <<'PY'\nprint(6 * 7)\nPY\nRUN [\"echo\", \"a b\"]\nRUN --mount=type=cache,target=/root/.cache "
        "pip install x\nCOPY <<EOF /etc/motd\nhello\nEOF\nCMD [\"bash\"]\n"))
    lone, fed, exec_form, mounted, copy, cmd = stage.steps
    assert lone.script == "echo one\necho two\n" and lone.shell == ("/bin/bash", "-c")
    assert fed.script == "python3 <<'PY'\nprint(6 * 7)\nPY"
    assert exec_form.script == "echo 'a b'"
    assert mounted.flags == {"mount": "type=cache,target=/root/.cache"} and mounted.script == "pip install x"
    assert copy.heredocs == (("EOF", "hello\n"),) and copy.words == ("<<EOF", "/etc/motd")
    assert cmd.op == "CMD" and cmd.words == ("bash",)


@pytest.mark.parametrize("text, message", [
    ("FROM x\nCOPPY a /app/\n", "environment/Dockerfile line 2: unknown instruction 'COPPY'"),
    ("RUN echo\nFROM x\n", "environment/Dockerfile line 1: RUN before the first FROM"),
    ("FROM x\nCOPY onlyone\n", "line 2: COPY needs a source and a destination"),
    ("FROM x y\n", "line 1: FROM 'x y' is not FROM image [AS name]"),
    ("FROM x\nENV A=${B:?required}\n", "line 2: B: required"),
    ("FROM x\nENV A=1 B\n", "environment/Dockerfile: Syntax error - can't find = in \"B\""),
    ("FROM x\nSHELL /bin/bash -c\n", "line 2: SHELL needs a JSON list"),
    ("# just a comment\n", "environment/Dockerfile: file with no instructions"),
])
def test_lines_docker_rejects_name_their_line(tmp_path, text, message):
    with pytest.raises(dockerfile.DockerfileError, match=message.replace("(", r"\(").replace("[", r"\[")):
        _read(tmp_path, text)


def test_an_exec_form_that_is_not_json_is_a_shell_command_as_in_docker(tmp_path):
    (stage,) = _read(tmp_path, "FROM x\nRUN [\"echo\", \n")
    assert stage.steps[0].script == "[\"echo\","  # BuildKit falls back to the shell form; the shell then fails
