"""cgroup.py: the sandbox's memory cap and CPU quota written as each cgroup version reads them."""

from envs.sandbox import cgroup


def test_cgroup_files_are_written_as_each_version_reads_them(tmp_path):
    """The v2 and v1 file protocols on directories standing in for the hierarchies (this
    machine has one of the two): limits in each version's files and units, one group to
    join under v2, one per controller under v1."""
    v2 = cgroup.Group(memory=("v2", str(tmp_path)), cpu=("v2", str(tmp_path)), memory_bytes=1 << 30, cpus=1.5)
    (path,) = {p for _, p in v2.paths.values()}
    assert open(f"{path}/memory.max").read() == str(1 << 30) and open(f"{path}/cpu.max").read() == "150000 100000"
    assert v2.procs == (f"{path}/cgroup.procs",)
    (tmp_path / "memory").mkdir()
    (tmp_path / "cpu").mkdir()
    v1 = cgroup.Group(memory=("v1", str(tmp_path / "memory")), cpu=("v1", str(tmp_path / "cpu")),
                      memory_bytes=512 << 20, cpus=0.5)
    memory, cpu = v1.paths["memory"][1], v1.paths["cpu"][1]
    assert open(f"{cpu}/cpu.cfs_quota_us").read() == "50000" and open(f"{cpu}/cpu.cfs_period_us").read() == "100000"
    assert len(v1.procs) == 2 and memory.startswith(str(tmp_path / "memory"))
    v1.set_limits(256 << 20, 2.0)
    assert open(f"{cpu}/cpu.cfs_quota_us").read() == "200000"


def test_a_v1_memory_limit_moves_up_and_down_in_the_order_the_kernel_allows(tmp_path, monkeypatch):
    """cgroup v1 refuses a memory limit above memory + swap's, and memory + swap's below the
    memory limit: a limit raised writes memsw first, one lowered writes memory first."""
    (tmp_path / "memory").mkdir()
    written = []
    real_write = cgroup._write

    def write(path, value):
        written.append((path.rsplit("/", 1)[1], int(value)))
        real_write(path, value)

    group = cgroup.Group(memory=("v1", str(tmp_path / "memory")), cpu=None, memory_bytes=512 << 20, cpus=1.0)
    for name in cgroup._V1_MEMORY_FILES:  # the files the kernel would show, as the group was made
        open(f"{group.paths['memory'][1]}/{name}", "a").close()
    monkeypatch.setattr(cgroup, "_write", write)
    group.set_limits(2 << 30, 1.0)
    group.set_limits(256 << 20, 1.0)
    assert written == [("memory.memsw.limit_in_bytes", 2 << 30), ("memory.limit_in_bytes", 2 << 30),
                       ("memory.limit_in_bytes", 256 << 20), ("memory.memsw.limit_in_bytes", 256 << 20)]
