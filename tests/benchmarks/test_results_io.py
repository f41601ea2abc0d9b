"""A rerun of a benchmark replaces its figures and keeps the file's findings."""

import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))

import results_io  # noqa: E402


def test_a_rerun_keeps_the_findings_and_replaces_the_figures(tmp_path):
    path = tmp_path / "bench.json"
    results_io.write(path, {"speedup": 1.5})
    assert json.loads(path.read_text()) == {"speedup": 1.5}
    on_disk = json.loads(path.read_text())
    path.write_text(json.dumps({**on_disk, "findings": ["a fused gather is 7x slower"]}))
    results_io.write(path, {"speedup": 2.0, "arms": [1, 2]})
    assert json.loads(path.read_text()) == {"speedup": 2.0, "arms": [1, 2], "findings": ["a fused gather is 7x slower"]}
    results_io.write(path, {"speedup": 3.0, "findings": ["new"]})  # a report's own findings win
    assert json.loads(path.read_text())["findings"] == ["new"]
