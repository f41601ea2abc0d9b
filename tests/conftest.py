"""Test-wide JAX setup: 8 fake CPU devices, a persistent compile cache, exact fp32 matmuls,
and compiled executables released after every test module.

The environment must be set before anything imports jax, which is why this lives in
conftest.py (imported by pytest before any test module).
"""

import gc
import os
import pathlib

_xla_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _xla_flags:
    _xla_flags += " --xla_force_host_platform_device_count=8"
if "xla_backend_optimization_level" not in _xla_flags:
    # The suite's time is compile time: LLVM at -O0 compiles a quarter faster, and the
    # tiny models' executables run in milliseconds either way.
    _xla_flags += " --xla_backend_optimization_level=0"
if "xla_cpu_use_fusion_emitters" not in _xla_flags:
    # XLA:CPU's older loop emitters compile the same programs in about half the time (the
    # SAO job's 84 programs: 17 s -> 9 s)
    _xla_flags += " --xla_cpu_use_fusion_emitters=false"
os.environ["XLA_FLAGS"] = _xla_flags.strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Tests compile for TPU topologies through libtpu (pallas_kernels/tpu, glmjax-aot), from both
# xdist workers at once: libtpu's one-process lockfile would refuse the second.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402  (after the environment above)
import pytest  # noqa: E402

_REPO = pathlib.Path(__file__).resolve().parent.parent
# tests/harbor_tasks holds task directories; their verifiers' test files are data, not tests of this suite
collect_ignore_glob = ["harbor_tasks/*"]

os.environ.setdefault("GLMJAX_JAX_CACHE", str(_REPO / ".jax_cache"))  # jobs started in subprocesses share it
jax.config.update("jax_compilation_cache_dir", os.environ["GLMJAX_JAX_CACHE"])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # every module reloads what it shares
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
jax.config.update("jax_enable_x64", False)
# Parity tests compare fp32 against torch at 1e-5; CPU matmuls must not drop to bf16 passes.
jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(scope="module", autouse=True)
def _release_executables():
    """Each XLA:CPU executable holds a few memory mappings for as long as jit's caches keep
    it; a worker that runs hundreds of tests would pass the kernel's limit of 65,530
    (vm.max_map_count), and LLVM then crashes mid-compile. Later modules reload what they
    share from the persistent cache."""
    yield
    jax.clear_caches()
    gc.collect()


# The files that take over a minute on 2 cores, slowest first. pytest.ini hands whole files
# to the xdist workers in collection order (--dist loadfile --no-loadscope-reorder), so
# these start first and the short files fill the gaps: no long file is left to run alone
# at the end while the other worker idles.
SLOWEST_FIRST = ("test_trainer.py", "test_multihost.py", "test_engine_groups.py", "test_train.py", "test_opd.py",
                 "test_notebook.py", "test_engine_spec.py", "test_learner.py", "test_model.py", "test_kernels.py",
                 "test_episode.py", "test_sharding.py", "test_engine_mesh.py", "test_engine.py", "test_sorting_job.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order
