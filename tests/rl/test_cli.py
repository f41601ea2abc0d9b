"""glmjax-train (rl/cli.py, glmjax/cli.py): a mistyped command line ends before any work with
the usage line and one `glmjax-train: error: ...` naming what is wrong, exit status 2."""

import pathlib

import pytest

from glmjax import cli as lm_cli
from rl import cli

REPO = pathlib.Path(__file__).resolve().parents[2]
SAO, OPD, TINY = (str(REPO / "configs" / f) for f in ("sao_tiny.py", "opd_tiny.py", "tiny.py"))

PICKY = '''
import ml_collections
from glmjax.presets import model_config_dict

def get_config(arg=None):
    if arg not in (None, "small"):
        raise ValueError(f"get_config(arg={arg!r}): expected 'small' or nothing")
    config = ml_collections.ConfigDict()
    config.model = model_config_dict()
    return config
'''


def _error(capsys, argv, main=cli.main) -> str:
    """The one error line of `main(argv)`, after checking the exit status and the output's shape."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.startswith("usage: glmjax-train")
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and err.rstrip("\n").endswith(errors[0]), err
    return errors[0].removeprefix("glmjax-train: error: ")


@pytest.mark.parametrize("config, overrides, message", [
    ("/nonexistent/sao.py", [], "--config: config file '/nonexistent/sao.py' does not exist"),
    (SAO, ["--config.rl.eta=abc"], f"--config {SAO}: override '--config.rl.eta=abc': cannot set rl.eta (a int) to "
                                   "'abc': invalid literal for int() with base 10: 'abc'"),
    (SAO, ["--config.rl.etaa=1"], f"--config {SAO}: unknown config key 'rl.etaa': config.rl has no field 'etaa'; "
                                  "valid fields of config.rl: actor_lr, actor_warmup, algorithm,"),
    (SAO, ["--rl.eta=1"], "unrecognised arguments ['--rl.eta=1']: overrides are written --config.a.b=value"),
    (SAO, ["--config.model.hidden_size=-3"],
     f"--config {SAO}: ModelConfig.hidden_size=-3 is invalid: expected a positive integer"),
    (SAO, ["--config.rl.algorithm=reinforce"], f"--config {SAO}: rl.algorithm='reinforce' is invalid: expected one of "
                                               "('sao', 'ppo', 'grpo', 'dapo', 'gspo')"),
    (SAO, ["--config.rl.algorithm=grpo"],
     f"--config {SAO}: rl.algorithm='grpo' compares rollouts of one prompt: set rl.group_size >= 2"),
    (SAO, ["--config.rl.group_size=3"], f"--config {SAO}: rl.batch_size=64 must be a positive multiple of "
                                        "rl.group_size=3"),
    (SAO, ["--config.task.family=sortin"], f"--config {SAO}: task.family='sortin' is unknown: expected a text family "
                                           "['arithmetic', 'counting', 'program', 'sorting', 'strings'] or a sandboxed "
                                           "one ['code_repair', 'lookup', 'ml_infra', 'security', 'terminal']"),
    (SAO, ["--config.task.max_len=100"], f"--config {SAO}: task.max_len=100 exceeds "
                                         "model.max_position_embeddings=64"),
    (SAO, ["--config.rl.compaction.enabled=True", "--config.rl.compaction.summary_tokens=1"],
     f"--config {SAO}: compaction needs summary_tokens >= 2"),
    (SAO, ["--config.mesh.fsdp=4", "--config.mesh.tensor=4"],
     f"--config {SAO}: config.mesh (fsdp=4,tensor=4) needs 16 devices; 8 are available"),
    (SAO, ["--config.mesh.fsdp=4", "--config.rl.engine_mesh=tensor=2"],
     f"--config {SAO}: rl.engine_mesh='tensor=2' spans 2 devices and config.mesh 4: give the engine as many devices "
     "as the learner (axis sizes that multiply to 4)"),
    (SAO, ["--config.mesh.fsdp=8", "--config.rl.engine_mesh=tensor=8"],
     f"--config {SAO}: rl.engine_mesh='tensor=8' needs 8 devices after the learner's 8; 8 are available"),
    (SAO, ["--config.rl.engine_mesh=tensors=2"], f"--config {SAO}: mesh 'tensors=2': unknown axis 'tensors'"),
    (SAO, ["--config.rules.embed=fsdp,experts"],
     f"--config {SAO}: sharding rule 'embed' -> ('fsdp', 'experts'): unknown mesh axis 'experts'"),
    (OPD, ["--config.opd.distribution=kl"], f"--config {OPD}: opd.distribution='kl' is invalid: expected one of "
                                            "('topk', 'full', 'sampled')"),
])
def test_a_bad_config_is_one_line_error_and_no_workdir(tmp_path, capsys, config, overrides, message):
    workdir = tmp_path / "run"
    assert _error(capsys, ["--config", config, "--workdir", str(workdir), *overrides]).startswith(message)
    assert not workdir.exists()


def test_get_config_rejecting_its_arg_or_missing_is_one_line_error(tmp_path, capsys):
    picky, empty = tmp_path / "picky.py", tmp_path / "empty.py"
    picky.write_text(PICKY)
    empty.write_text("X = 1\n")
    run = ["--workdir", str(tmp_path / "run")]
    assert _error(capsys, ["--config", f"{picky}:huge", *run]) == \
        f"--config {picky}:huge: get_config(arg='huge'): expected 'small' or nothing"
    assert _error(capsys, ["--config", str(empty), *run]) == \
        f"--config {empty}: config file {str(empty)!r} defines no get_config(arg=None)"
    assert _error(capsys, ["--config", f"{picky}:small", *run]) == (  # a model preset: it names the job configs
        f"--config {picky}:small: the config is a model preset with none of the sections `rl` (RL job), `opd` "
        "(distillation) or `train` (language model): job configs load it, e.g. configs/glm53_sao.py (glmjax-train, "
        "or glmjax-aot --topology v5p:8x8x4 to compile it for a TPU slice; python -m rl.job_plan for its memory plan)")
    assert _error(capsys, ["--config", str(picky), *run], main=lm_cli.train_main) == \
        f"--config {picky}: the config has no `train` section (steps, batch_size, seq_len, ...)"


def test_a_workdir_that_cannot_be_a_directory_is_one_line_error(tmp_path, capsys):
    a_file = tmp_path / "summary.json"
    a_file.write_text("{}")
    assert _error(capsys, ["--config", TINY, "--workdir", str(a_file)]) == \
        f"--workdir {a_file} is a file, not a directory"
    assert _error(capsys, ["--config", TINY, "--workdir", str(a_file / "run")]) == \
        f"--workdir {a_file / 'run'} cannot be created: Not a directory"
    assert a_file.read_text() == "{}"
