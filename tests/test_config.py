import argparse

import pytest

from effitrain import config as cfg
from effitrain.cli import build_parser
from effitrain.errors import UserError


def test_every_train_flag_is_a_config_key():
    train = build_parser()._subparsers._group_actions[0].choices["train"]
    dests = {a.dest for a in train._actions if a.dest not in ("help", "config")}
    assert dests == {f.name for f in cfg.cli_fields()}
    # The one key that is not a flag: the plan an earlier run resolved, which only its config.yaml carries.
    assert {f.name for f in cfg.fields()} - dests == {"plan"}
    flags = {s for a in train._actions for s in a.option_strings}
    for f in cfg.cli_fields():
        assert cfg.flag(f.name) in flags


def test_cli_overrides_file_and_file_overrides_defaults(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("lr: 0.001\nbatch_size: 8\nepochs: 3\n")
    args = build_parser().parse_args(["train", "--config", str(path), "--batch-size", "4"])
    values = {k: v for k, v in vars(args).items() if k not in ("command", "config")}
    config = cfg.build(cfg.load_yaml(path), values)
    assert (config.lr, config.batch_size, config.epochs, config.seed) == (0.001, 4, 3, 42)
    assert config.max_length == cfg.TrainConfig().max_length


def test_bool_flags_have_a_negative_form():
    args = build_parser().parse_args(["train", "--no-group-by-length", "--overwrite"])
    assert args.group_by_length is False and args.overwrite is True
    assert not hasattr(build_parser().parse_args(["train"]), "lr")  # unset flags do not mask the file


@pytest.mark.parametrize("text, needle", [
    ("lr: fast\n", "`lr` must be float"),
    ("batch_size: 2.5\n", "`batch_size` must be int"),
    ("overwrite: 1\n", "`overwrite` must be bool"),
    ("bach_size: 8\n", "did you mean `batch_size`"),
    ("- lr\n", "must be a mapping"),
    ("lr: [\n", "not valid YAML"),
])
def test_bad_yaml_is_one_clear_line(tmp_path, text, needle):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(UserError) as err:
        cfg.load_yaml(path)
    assert needle in str(err.value) and "\n" not in str(err.value) and "fix:" in str(err.value)


def test_yaml_int_is_accepted_for_float(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("lr: 1\nmax_steps: null\n")
    assert cfg.load_yaml(path) == {"lr": 1.0, "max_steps": None}


@pytest.mark.parametrize("values, needle", [
    ({"batch_size": 0}, "--batch-size must be > 0"),
    ({"lr": -1.0}, "--lr must be > 0"),
    ({"warmup_ratio": 1.5}, "--warmup-ratio"),
    ({"validation_split": 0.0}, "--validation-split"),
    ({"task": "translation"}, "unknown task"),
    ({"max_grad_norm": -1.0}, "--max-grad-norm"),
])
def test_bad_values_are_refused(values, needle):
    with pytest.raises(UserError, match=needle):
        cfg.build(cli_values=values)


def test_api_accepts_dict_and_refuses_unknown_keys():
    assert cfg.from_any({"lr": 1}).lr == 1.0
    with pytest.raises(UserError, match="unknown key `learning_rate`"):
        cfg.from_any({"learning_rate": 1e-4})


def test_api_copies_the_callers_config():
    mine = cfg.TrainConfig()
    assert cfg.from_any(mine) is not mine


def test_missing_config_file(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        cfg.load_yaml(tmp_path / "nope.yaml")
