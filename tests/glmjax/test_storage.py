"""glmjax/storage.py and the RL job's files on an object store: gs:// paths go through
etils.epath to fsspec, here an in-memory filesystem registered for the gs protocol (what
gcsfs is on a real bucket), and nothing lands in a local ./gs: directory."""

import json
import os

import fsspec
import jax
import numpy as np
import pytest
from flax import nnx
from fsspec.implementations.memory import MemoryFileSystem

import glmjax
from glmjax import storage
from tests.glmjax.test_scan import SMALL


class MemoryGCS(MemoryFileSystem):
    """gs:// in memory: epath asks fsspec for the "gcs" protocol with finalize_on_close."""

    protocol = ("gs", "gcs")

    def __init__(self, *args, finalize_on_close=None, **kwargs):
        super().__init__(*args, **kwargs)


@pytest.fixture
def bucket(monkeypatch, tmp_path):
    for name in ("gs", "gcs"):
        fsspec.register_implementation(name, MemoryGCS, clobber=True)
    MemoryGCS.store.clear()
    MemoryGCS.pseudo_dirs.clear()
    monkeypatch.chdir(tmp_path)  # a path mistaken for a local one would appear here
    yield "gs://bucket/run"
    assert not (tmp_path / "gs:").exists()
    import importlib

    importlib.import_module("fsspec.registry")._registry.pop("gs", None)
    importlib.import_module("fsspec.registry")._registry.pop("gcs", None)


def test_files_logs_and_directories_round_trip_through_the_bucket(bucket):
    run = storage.makedirs(bucket)
    storage.write_text(run / "summary.json", json.dumps({"steps": 3}))
    assert json.loads(storage.read_text(f"{bucket}/summary.json")) == {"steps": 3}
    log = storage.AppendLog(f"{bucket}/metrics.jsonl")
    log.write("1\n")
    log.flush()
    assert storage.read_text(f"{bucket}/metrics.jsonl") == "1\n"
    log.write("2\n")
    log.close()
    again = storage.AppendLog(f"{bucket}/metrics.jsonl")  # a resumed run appends after the earlier lines
    again.write("3\n")
    again.close()
    assert storage.read_text(f"{bucket}/metrics.jsonl") == "1\n2\n3\n"
    with storage.writing(f"{bucket}/dir") as local:
        os.makedirs(os.path.join(local, "sub"))
        open(os.path.join(local, "sub", "a.txt"), "w").write("a")
        open(os.path.join(local, "config.json"), "w").write("{}")
    with storage.reading(f"{bucket}/dir") as local:
        assert open(os.path.join(local, "sub", "a.txt")).read() == "a"
    assert storage.set_aside(f"{bucket}/dir") == f"{bucket}/dir.corrupt"
    assert not storage.exists(f"{bucket}/dir") and storage.exists(f"{bucket}/dir.corrupt/sub/a.txt")
    fetched = storage.fetched(f"{bucket}/dir.corrupt")
    assert open(os.path.join(fetched, "sub", "a.txt")).read() == "a"


def test_the_jobs_export_base_cache_and_logs_on_the_bucket(bucket):
    """rl/export.py, rl/base_model.py's cache and rl/job_log.py with a gs:// workdir."""
    from rl.export import export
    from rl.job_log import JobLog

    config = glmjax.ModelConfig(num_hidden_layers=2, index_topk_pattern="FS", **SMALL)
    model = glmjax.init_model(config, seed=1)
    export(model, f"{bucket}/export/final")
    with storage.reading(f"{bucket}/export/final") as local:
        loaded = glmjax.from_pretrained(local)
    for a, b in zip(jax.tree.leaves(nnx.state(loaded)), jax.tree.leaves(nnx.state(model))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    log = JobLog(bucket, steps=10, initial=0)
    log.step(10, {"version": 10}, {"reward": 0.5}, [0, 1])
    log.close()
    rows = storage.read_text(f"{bucket}/metrics.jsonl").splitlines()
    assert json.loads(rows[0])["reward"] == 0.5
    assert any(name.name.startswith("events.out.tfevents") for name in storage.path(f"{bucket}/tb").iterdir())
