"""One engine over the devices of two processes (rl/engine/lockstep.py): each process
submits its own requests, from its main thread and from another, and the tokens, log-probs
and routes are those of the same requests on one process of 8 devices; a cancellation on
one process ends that request on both; work that blocks on process 0 alone is served while
process 1 keeps in step; each process places only its own rows of a learner batch; and
`distributed.gather_objects` returns values longer and shorter than its inline part."""

import json
import pathlib
import subprocess
import sys

import numpy as np

from tests.glmjax.test_multihost import _free_port

WORKER = pathlib.Path(__file__).with_name("lockstep_worker.py")


def _run(num_processes: int, out: pathlib.Path) -> dict:
    port = str(_free_port())
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(i), str(num_processes), port, str(out)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(num_processes)]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=600)[0])  # a process out of step hangs, and fails here
        finally:
            p.kill()
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]
    return {i: json.loads(pathlib.Path(f"{out}{i}").read_text()) for i in range(num_processes)}


def test_two_processes_step_one_engine_as_one_process_does(tmp_path):
    two, one = _run(2, tmp_path / "two"), _run(1, tmp_path / "one")[0]
    got = {**two[0]["results"], **two[1]["results"]}
    assert sorted(two[0]["results"]) == ["0", "2", "4", "6"] and sorted(two[1]["results"]) == ["1", "3", "5", "7"]
    assert sorted(got) == sorted(one["results"])
    for i, expected in one["results"].items():
        r = got[i]
        if i == "5":  # cancelled once its first chunk arrived: on both processes' copies of the driver
            assert r["finish_reason"] == expected["finish_reason"] == "cancelled", (r, expected)
            assert 1 <= len(r["tokens"]) < 40
            continue
        assert r["finish_reason"] == expected["finish_reason"] == "length"
        assert r["tokens"] == expected["tokens"], i
        np.testing.assert_allclose(r["log_probs"], expected["log_probs"], atol=1e-5)
        assert r["routes"] == expected["routes"], i
    assert two[0]["syncs"] == two[1]["syncs"]  # every step on both
    assert two[0]["gathered"] == two[1]["gathered"] == [1000, 2000, 0, 1] and one["gathered"] == [1000, 0]
    assert two[0]["in_flight"] == two[1]["in_flight"] == 0
    assert two[0]["served"] == one["served"] and len(two[0]["served"]) == 2 and two[1]["served"] is None
    # the learner's rows: each process holds half, disjoint, and the placed batch is the whole one
    rows = [set(two[p]["rows"]) for p in (0, 1)]
    assert len(rows[0]) == len(rows[1]) == 8 and not rows[0] & rows[1] and two[0]["disjoint"]
    assert one["rows"] == list(range(16))
    expected = float((np.arange(48, dtype=np.float64).reshape(16, 3) * np.arange(1, 17)[:, None]).sum())
    assert two[0]["weighted"] == two[1]["weighted"] == one["weighted"] == expected
