"""glmjax-envs: bad input is one line naming what is wrong (exit 2), never a traceback."""

import pytest

from envs.cli import main
from tests.harbor_util import write_task


def _error(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1 and err.lstrip().startswith("usage: glmjax-envs"), err
    return lines[0]


def _argparse_error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


def test_missing_and_empty_directories_are_named(tmp_path, capsys):
    assert str(tmp_path / "nope") in _error(capsys, ["validate", str(tmp_path / "nope")])
    (tmp_path / "empty").mkdir()
    assert "no task directories" in _error(capsys, ["validate", str(tmp_path / "empty")])
    assert "neither task.toml" in _error(capsys, ["run", str(tmp_path / "empty")])


def test_a_malformed_task_names_file_field_and_type(tmp_path, capsys):
    task = write_task(tmp_path, "bad-meta", extra_toml="")
    text = (task / "task.toml").read_text().replace('[metadata]\ndifficulty = "easy"\ncategory = "file-ops"\n'
                                                    'tags = ["test"]\n', "metadata = 5\n")
    (task / "task.toml").write_text(text)
    line = _error(capsys, ["run", str(task)])
    assert "task.toml" in line and "[metadata] must be a table, got integer 5" in line, line
    (task / "task.toml").write_text(text.replace("metadata = 5\n", "[verifier]\n").replace(
        "[verifier]\ntimeout_sec = 20.0", 'timeout_sec = "soon"'))
    line = _error(capsys, ["run", str(task)])
    assert "[verifier] timeout_sec must be a number of seconds, got string 'soon'" in line, line
    (task / "task.toml").write_text("[metadata\n")
    assert "not valid TOML" in _error(capsys, ["run", str(task)])


def test_unsupported_task_and_bad_model_are_one_line(tmp_path, capsys):
    task = write_task(tmp_path, "ffmpeg", dockerfile="FROM ubuntu\nRUN apt-get install -y glmjax-no-such-tool\n")
    assert "Debian package glmjax-no-such-tool: Unable to locate package" in _error(capsys, ["run", str(task)])
    good = write_task(tmp_path, "good")
    assert "--model 'gpt'" in _error(capsys, ["run", str(good), "--model", "gpt"])


def test_bad_values_are_refused_by_the_parser(tmp_path, capsys):
    assert "unknown family 'nosuch'" in _argparse_error(capsys, ["generate", str(tmp_path), "--family", "nosuch=3"])
    assert "COUNT must be an integer" in _argparse_error(capsys, ["generate", str(tmp_path), "--family", "terminal=x"])
    assert "comma-separated integers" in _argparse_error(capsys, ["eval", "--k", "1,x"])
    assert "must be >= 1" in _argparse_error(capsys, ["validate", str(tmp_path), "--workers", "0"])
    assert "does not export to Harbor" in _error(capsys, ["export", "arithmetic", str(tmp_path)])
    assert "unknown" in _error(capsys, ["eval", "--categories", "terminal,cooking"])


def test_out_must_be_a_directory(tmp_path, capsys):
    write_task(tmp_path / "tasks", "good")
    (tmp_path / "file").write_text("x")
    assert "is a file" in _error(capsys, ["validate", str(tmp_path / "tasks"), "--out", str(tmp_path / "file")])
