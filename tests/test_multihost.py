"""Two local processes of 4 CPU devices each (gloo collectives) run one sharded train step
and agree with one process of 8 devices; the updated model saved as an HF checkpoint and
loaded back on expert=4 x tensor=2 has the same parameters, each process having read only
its own experts."""

import json
import pathlib
import socket
import subprocess
import sys

WORKER = pathlib.Path(__file__).with_name("multihost_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(num_processes: int, out: pathlib.Path) -> dict:
    port = str(_free_port())
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(i), str(num_processes), port, str(out)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(num_processes)]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=600)[0])
        finally:
            p.kill()
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]
    return json.loads(out.read_text())


def test_two_processes_match_one(tmp_path):
    two = _run(2, tmp_path / "two.json")
    one = _run(1, tmp_path / "one.json")
    assert two["process_count"] == 2 and one["process_count"] == 1
    for key in ("loss", "grad_norm", "checksum", "next_loss", "loaded_checksum"):
        assert abs(two[key] - one[key]) <= 1e-5 * max(1.0, abs(one[key])), (key, two[key], one[key])
    assert two["next_loss"] < two["loss"]
    assert abs(two["loaded_checksum"] - two["checksum"]) <= 1e-5 * two["checksum"]
    assert two["experts_read"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert one["experts_read"] == [list(range(8))]
