"""notebooks/ablations.ipynb runs top to bottom with SMOKE=True and writes its figures.

Parameters are injected as papermill does, in a cell after the one tagged `parameters`;
the kernel gets one CPU device, as a reader's laptop would.
"""

import json
import os
import pathlib

import nbformat
from nbclient import NotebookClient

REPO = pathlib.Path(__file__).resolve().parents[2]
NOTEBOOK = REPO / "notebooks" / "ablations.ipynb"
ARMS = {"sao", "grpo", "indexshare_off", "compaction_on", "compaction_off", "shaping", "replay", "augment"}


def with_parameters(nb, **params):
    (i,) = [i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", [])]
    cell = nbformat.v4.new_code_cell("\n".join(f"{k} = {v!r}" for k, v in params.items()))
    cell.metadata["tags"] = ["injected-parameters"]
    nb.cells.insert(i + 1, cell)
    return nb


def test_the_parameters_cell_has_a_smoke_switch_off_by_default():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    (cell,) = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert "SMOKE = False" in cell.source


def test_notebook_runs_in_smoke_mode(tmp_path, monkeypatch):
    results, figure = tmp_path / "ablations.json", tmp_path / "ablations.png"
    # One process: the arms share the kernel's compiled steps, and pytest's other worker has the second core.
    nb = with_parameters(nbformat.read(NOTEBOOK, as_version=4), SMOKE=True, WORKDIR=str(tmp_path / "runs"),
                         RESULTS_JSON=str(results), FIGURE_PNG=str(figure), PROCESSES=1)
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "host_platform_device_count" not in f]
    monkeypatch.setenv("XLA_FLAGS", " ".join(flags))
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    NotebookClient(nb, timeout=1500, kernel_name="python3",
                   resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()

    r = json.loads(results.read_text())
    assert r["smoke"] and set(r["arms"]) == ARMS
    for name, arm in r["arms"].items():
        assert arm["steps"] == r["rl_steps"], name
        assert 0.0 <= arm["base_pass_rate"] <= 1.0 and 0.0 <= arm["final_pass_rate"] <= 1.0, name
    assert r["arms"]["grpo"]["algorithm"] == "grpo" and r["arms"]["sao"]["algorithm"] == "sao"
    assert [r["arms"][a]["overrides"] for a in ("shaping", "replay", "augment")] == [
        ["rl.reward_shaping=pass_rate"], ["rl.replay.enabled=True"], ["task.augment=distractor,reorder"]]
    assert r["indexshare_speed"]["sao"]["forward_ms"] > 0 and r["indexshare_speed"]["indexshare_off"]["forward_ms"] > 0
    assert figure.stat().st_size > 10_000
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if "image/png" in o.get("data", {})]
    assert images, "the plot cell showed no figure"
