"""Images built from a Dockerfile into a cached layer (envs/image/build.py, envs/image/context.py)
by the build sandbox (envs/sandbox/build.py), and laid over a sandbox's root."""

import io
import os
import re
import stat
import tarfile

import pytest

from envs.image import build, context
from envs.sandbox import isolation
from envs.sandbox.sandbox import Sandbox


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("GLMJAX_IMAGE_CACHE", str(tmp_path / "cache"))


def _task(tmp_path, dockerfile, files=(), compose=None, name="task"):
    root = tmp_path / name
    for rel, data in dict(files).items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data if isinstance(data, bytes) else data.encode())
    (root / "environment").mkdir(parents=True, exist_ok=True)
    (root / "environment" / "Dockerfile").write_text(dockerfile)
    if compose is not None:
        (root / "environment" / "docker-compose.yaml").write_text(compose)
    return str(root)


def _build(path, layout="harbor"):
    return build.build(context.locate(path, layout))


def test_a_run_step_writes_its_layer_and_never_the_host(tmp_path):
    probe = ("id -u > /probe.txt; grep -E '^(CapEff|CapBnd|NoNewPrivs)' /proc/self/status >> /probe.txt; "
             "ls /proc >> /probe.txt; ls /sys 2>&1 | tail -1 >> /probe.txt; "
             "(mount -t tmpfs none /mnt 2>&1 || true) | head -1 >> /probe.txt; "
             "(echo 1 > /proc/sys/kernel/sysrq) 2>> /probe.txt || true; grep -c '^root:\\*:' /etc/shadow >> /probe.txt")
    image = _build(_task(tmp_path, f"FROM ubuntu:24.04\nRUN echo x > /etc/hosts_evil; touch /usr/evil\n"
                                   f"RUN mkdir -p /queries && echo 'select 1;' > /queries/q.sql\nRUN {probe}\n"))
    assert image.unsupported is None, image.unsupported
    assert not os.path.exists("/etc/hosts_evil") and not os.path.exists("/usr/evil")
    layer = image.layer
    assert open(f"{layer}/etc/hosts_evil").read() == "x\n" and os.path.isfile(f"{layer}/usr/evil")
    assert open(f"{layer}/queries/q.sql").read() == "select 1;\n"
    found = open(f"{layer}/probe.txt").read().splitlines()
    caps = sum(1 << c for c in isolation.BUILD_CAPS)
    assert found[0] == "0" and f"CapEff:\t{caps:016x}" in found and f"CapBnd:\t{caps:016x}" in found, found
    assert "NoNewPrivs:\t1" in found and "sys" not in found and "sysrq-trigger" not in found
    assert any("No such file or directory" in line for line in found[3:]), found  # no /sys
    assert any("permission denied" in line.lower() for line in found), found  # mount needs CAP_SYS_ADMIN
    assert found[-1] != "0" or not os.path.isfile("/etc/shadow")  # the host's hashes are not there to copy


def test_copy_and_add_follow_dockers_rules_anywhere_in_the_tree(tmp_path):
    archive = io.BytesIO()
    with tarfile.open(fileobj=archive, mode="w:gz") as tar:
        info = tarfile.TarInfo("pkg/data.txt")
        info.size = 3
        tar.addfile(info, io.BytesIO(b"tar"))
    files = {"environment/a.txt": "a", "environment/b.py": "b", "environment/c.py": "c",
             "environment/conf/x.ini": "x", "environment/bundle.tgz": archive.getvalue(),
             "environment/tool.sh": "#!/bin/sh\necho tool-ok\n", "environment/skip.log": "no",
             "environment/.dockerignore": "*.log\n"}
    docker = ("FROM python:3.11-slim\nCOPY a.txt /data.csv\nCOPY *.py /opt/src/\nCOPY conf /etc/myconf\n"
              "ADD bundle.tgz /srv/vendor/\nCOPY --chmod=755 tool.sh /usr/local/bin/tool\n"
              "COPY --chown=1234:1234 a.txt /home/owned/\nCOPY <<EOF /etc/motd.d/hello\nhi there\nEOF\n"
              "WORKDIR /app\nCOPY . .\nRUN mkdir -p output && cp /data.csv copied.csv\n")
    image = _build(_task(tmp_path, docker, files))
    assert image.unsupported is None, image.unsupported
    layer = image.layer
    assert open(f"{layer}/data.csv").read() == "a" and sorted(os.listdir(f"{layer}/opt/src")) == ["b.py", "c.py"]
    assert open(f"{layer}/etc/myconf/x.ini").read() == "x" and open(f"{layer}/srv/vendor/pkg/data.txt").read() == "tar"
    assert stat.S_IMODE(os.stat(f"{layer}/usr/local/bin/tool").st_mode) == 0o755
    assert os.stat(f"{layer}/home/owned/a.txt").st_uid == 1234 and os.stat(f"{layer}/data.csv").st_uid == 0
    assert open(f"{layer}/etc/motd.d/hello").read() == "hi there\n"
    app, modes = image.contents("app")
    assert "skip.log" not in app and app["copied.csv"] == b"a" and modes["output/"] == 0o755  # .dockerignore
    assert modes["tool.sh"] == 0o644 and not os.path.exists(f"{layer}/app")  # the working directory is /app's


def test_stages_users_and_the_cache(tmp_path, monkeypatch):
    docker = ("FROM python:3.11-slim AS builder\nRUN mkdir -p /out && echo built > /out/artifact.txt\n"
              "FROM builder AS tested\nRUN cat /out/artifact.txt\n"
              "FROM python:3.11-slim\nCOPY --from=builder /out/artifact.txt /opt/artifact.txt\n"
              "RUN useradd --create-home --uid 4321 agent\nUSER agent\nRUN id -u > /home/agent/uid\nWORKDIR /app\n")
    path = _task(tmp_path, docker)
    image = _build(path)
    assert image.unsupported is None, image.unsupported
    assert open(f"{image.layer}/opt/artifact.txt").read() == "built\n"
    assert open(f"{image.layer}/home/agent/uid").read() == "4321\n" and image.user == "agent"
    assert any(n.startswith("USER agent") for n in image.notes)
    shadow = open(f"{image.layer}/etc/shadow").read()  # written through the mask: no password hash of the host's
    assert "\nagent:" in shadow and not re.search(r"^[^:]*:\$", shadow, re.M), shadow

    with Sandbox(layer=image.layer, user="agent") as box:  # the sandbox's uid takes the image's user's name
        assert box.run("whoami; echo ~agent").output.split() == ["agent", "/home/agent"]

    def no_build(*args):
        raise AssertionError("the cached image was built again")

    monkeypatch.setattr(build._Build, "run", no_build)
    assert _build(path).path == image.path
    with open(os.path.join(path, "environment", "new.txt"), "w") as f:
        f.write("a change to the context")
    with pytest.raises(AssertionError, match="built again"):
        _build(path)


def test_the_sandbox_sees_the_layer_read_only(tmp_path):
    docker = ("FROM ubuntu:24.04\nRUN printf 'a,b\\n1,2\\n' > /data.csv && mkdir -p /opt/tool && "
              "printf '#!/bin/sh\\necho tool-ok\\n' > /opt/tool/run && chmod +x /opt/tool/run && "
              "echo evil > /etc/hosts_evil && rm -f /etc/debian_version && ln -s /data.csv /data-link\n")
    host_has = os.path.exists("/etc/debian_version")
    image = _build(_task(tmp_path, docker))
    assert image.unsupported is None, image.unsupported
    script = ("cat /data.csv /etc/hosts_evil /data-link; /opt/tool/run; test -e /etc/debian_version || echo hidden; "
              "(echo y > /data.csv) 2>/dev/null || echo read-only; touch /usr/x 2>/dev/null || echo ro-usr")
    with Sandbox(layer=image.layer) as box:
        for verifier in (False, True):
            out = box.run(script, verifier=verifier).output.splitlines()
            assert out == ["a,b", "1,2", "evil", "a,b", "1,2", "tool-ok", "hidden", "read-only", "ro-usr"], out
    assert os.path.exists("/etc/debian_version") == host_has  # the host keeps its own


@pytest.mark.parametrize("docker, reason", [
    ("FROM x\nADD https://example.com/f /opt/f\n", "environment/Dockerfile line 2: ADD https://example.com/f"),
    ("FROM x\nCOPY --from=nginx:1.25 /etc/nginx /etc/nginx\n", "line 2: COPY --from=nginx:1.25: copying from"),
    ("FROM x\nRUN echo building && exit 3\n", "line 2: RUN echo building && exit 3 fails in the build sandbox"),
    ("FROM x\nCOPY ../secret /opt/\n", "COPY source '../secret' is outside the build context"),
    ("FROM x\nUSER nobody-here\nRUN true\n", "line 2: USER nobody-here: no such user in the image"),
    ("FROM x\nCOPY <<EOF /start.sh\nsleep 1\nEOF\nENTRYPOINT [\"/start.sh\"]\nCMD [\"bash\"]\n",
     "line 5: ENTRYPOINT /start.sh: the image's container starts it"),
])
def test_what_cannot_be_reproduced_names_its_step(tmp_path, docker, reason):
    image = _build(_task(tmp_path, docker))
    assert image.unsupported and reason in image.unsupported, image.unsupported


def test_a_build_docker_would_fail_is_an_error(tmp_path):
    with pytest.raises(build.BuildError, match="line 2: COPY source 'missing.txt' is not in the build context"):
        _build(_task(tmp_path, "FROM x\nCOPY missing.txt /app/\n"))


def test_the_compose_file_places_the_context(tmp_path):
    files = {"app/main.py": "print('from the task root')\n", "environment/Dockerfile.dockerignore": "app/*.log\n",
             "app/noise.log": "x"}
    compose = "services:\n  main:\n    build:\n      context: ..\n      dockerfile: environment/Dockerfile\n"
    path = _task(tmp_path, "FROM python:3.11-slim\nWORKDIR /app\nCOPY app/ .\n", files, compose)
    source = context.locate(path, "harbor")
    assert source.context == os.path.realpath(path) and source.where == "environment/Dockerfile"
    assert source.ignore == ("app/*.log",) and context.ignored("app/noise.log", source.ignore)
    assert build.build(source).contents("app")[0] == {"main.py": b"print('from the task root')\n"}

    second = _task(tmp_path, "FROM x\n", compose="services:\n  main:\n    build: .\n  db:\n    image: postgres:16\n",
                   name="two")
    assert "service 'db' is a second container" in context.locate(second, "harbor").unsupported
    outside = _task(tmp_path, "FROM x\n", compose="services:\n  main:\n    build:\n      context: ../..\n",
                    name="outside")
    assert "is outside the task's directory" in context.locate(outside, "harbor").unsupported
