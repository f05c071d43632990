import dataclasses

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


def command_parser(name: str):
    return build_parser()._subparsers._group_actions[0].choices[name]


def test_every_field_has_a_section_help_and_only_known_rules():
    known = {"help", "section", "yaml_only", "example", "problem", "fix", "ends", "check", "resume", "added_later", "resume_first", "resume_fix", "must_match_with",
             *cfg.RULES}
    for f in cfg.fields():
        assert f.metadata["section"] in cfg.SECTIONS, f.name
        assert cfg.help_of(f.name).strip(), f.name
        assert set(f.metadata) <= known, (f.name, set(f.metadata) - known)  # a misspelt rule would check nothing
    assert {f.metadata["section"] for f in cfg.fields()} == set(cfg.SECTIONS)


def _base(name: str) -> dict:
    """Values under which the field's own rule is the one that speaks (--lora-* apply with --peft, online RL's
    flags with --rl, distillation's with --distill-from a model folder)."""
    if name in cfg.RL_SETTINGS:
        return {"rl": "grpo", "task": "causal-lm"}
    if name == "distill_beta":  # on-policy distillation's own: --rl distill with a teacher folder
        from effitrain.models.loading import default_model_dir

        return {"rl": "distill", "task": "causal-lm", "distill_from": str(default_model_dir())}
    if name in cfg.DISTILL_SETTINGS:
        from effitrain.models.loading import default_model_dir

        return {"distill_from": str(default_model_dir())}
    return {"peft": "lora"} if name in cfg.LORA_SETTINGS else {}


def _refused_and_accepted(f: dataclasses.Field) -> tuple[list, list]:
    """Values each rule of the field refuses, and its closed bounds (which it accepts)."""
    kind, _ = cfg.base_type(cfg.field_types()[f.name])
    rules, refused, accepted = f.metadata, [], []
    if rules.get("positive"):
        refused += [kind(0), kind(-1)]
    if "at_least" in rules:
        refused.append(kind(rules["at_least"] - 1))
        accepted.append(kind(rules["at_least"]))
    if "within" in rules:
        (lo, hi), ends = rules["within"], rules.get("ends", "[)")
        refused += [kind(lo - 1), kind(hi + 1)] + ([kind(lo)] if ends[0] == "(" else []) + (
            [kind(hi)] if ends[1] == ")" else [])
        accepted += ([kind(lo)] if ends[0] == "[" else []) + ([kind(hi)] if ends[1] == "]" else [])
    if "choices" in rules:
        refused.append(kind(99) if kind is int else "nope")
    if rules.get("nonempty"):
        refused.append(" ")
    return refused, accepted


RULED = [f for f in cfg.fields() if set(f.metadata) & set(cfg.RULES)]


@pytest.mark.parametrize("f", RULED, ids=[f.name for f in RULED])
def test_every_rule_in_the_metadata_is_enforced(f):
    refused, accepted = _refused_and_accepted(f)
    assert refused
    for value in refused:
        with pytest.raises(UserError) as err:
            cfg.build(cli_values={**_base(f.name), f.name: value})
        words = str(err.value)
        assert f.name.replace("_", "-") in words and "\n" not in words and "fix:" in words, (value, words)
    for value in accepted:
        cfg.build(cli_values={**_base(f.name), f.name: value})


@pytest.mark.parametrize("values, words", [
    ({"zero_stage": 4}, "--zero-stage must be 1, 2 or 3, got 4; fix: pass --zero-stage 2"),
    ({"precision": "fp8"}, "unknown --precision `fp8`; fix: pass one of auto, fp32, bf16, fp16"),
    ({"strategy": "tp"}, "unknown strategy `tp`; fix: pass --strategy ddp or fsdp or deepspeed"),
    ({"keep": "worst"}, "unknown --keep `worst`; fix: pass --keep final or best"),
    ({"beta2": 1.0}, "--beta2 must be in [0, 1), got 1.0; fix: pass e.g. --beta2 0.9"),
    ({"seed": 2**32}, "--seed must be in [0, 2**32), got 4294967296; fix: pass e.g. --seed 42"),
    ({"test_split": 0.5}, "--test-split must be in (0, 0.5), got 0.5; fix: pass e.g. --test-split 0.1"),
    ({"weight_decay": -1.0}, "--weight-decay must be >= 0, got -1.0; fix: pass 0 or more to --weight-decay"),
    ({"early_stopping_threshold": -1.0},
     "--early-stopping-threshold must be >= 0 and finite, got -1.0; fix: pass e.g. --early-stopping-threshold 0.001"),
    ({"peft": "lora", "lora_r": 0}, "--lora-r must be >= 1, got 0; fix: pass e.g. --lora-r 8"),
    ({"peft": "lora", "lora_alpha": 0.0}, "--lora-alpha must be > 0, got 0.0; fix: pass e.g. --lora-alpha 16"),
    ({"keep_last": 0}, "--keep-last must be > 0, got 0; fix: pass a positive value to --keep-last"),
    ({"run_name": " "}, "--run-name is empty; fix: pass a value to --run-name, or leave the flag out"),
    ({"lr": float("nan")}, "--lr must be a finite number, got nan; fix: pass e.g. --lr 0.0001"),
])
def test_refusals_keep_their_words(values, words):
    with pytest.raises(UserError) as err:
        cfg.build(cli_values=values)
    assert str(err.value) == words


def test_train_help_is_grouped_by_section_in_order():
    text = command_parser("train").format_help()
    at = [text.index(f"\n{section}:\n") for section in cfg.SECTIONS]
    assert at == sorted(at)
    schedule = text.index("\nschedule:\n")
    assert text.index("--batch-size", schedule) < text.index("\noptimizer:\n")


# The flags each command shares with train: the field's help, and (but evaluate's) train's default.
SHARED = {
    "plan": ["model", "task", "student_layers", "strategy", "zero_stage", "peft", "lora_r", "lora_dropout", "lora_target_modules"],
    "bench": ["model", "task", "data", "batch_size", "max_length", "seed", "overwrite"],
    "inspect": ["task", "student_layers"],
    "predict": ["max_duration", "allow_pickle"],
    "evaluate": ["data", "seed", "max_length", "eval_batch_size", "precision", "allow_pickle"],
}


@pytest.mark.parametrize("command", SHARED)
def test_shared_flags_have_the_fields_help_and_defaults(command):
    parser = command_parser(command)
    actions = {a.dest: a for a in parser._actions}
    defaults = vars(parser.parse_args(["--model", "m"] if command in ("predict", "evaluate") else []))
    for name in SHARED[command]:
        action = actions[name]
        assert action.help.startswith(cfg.help_of(name)), (command, name)
        assert action.choices == cfg.meta(name).get("choices"), (command, name)
        if command != "evaluate" or name == "allow_pickle":  # evaluate's data flags: train's defaults fill them
            assert defaults[name] == cfg.train_defaults(name)[name], (command, name)


def test_plan_keeps_its_own_lists_from_the_fields_choices():
    actions = {a.dest: a for a in command_parser("plan")._actions}
    assert actions["precision"].choices == ["fp32", "bf16", "fp16"]
    assert list(actions["optim"].choices) == list(cfg.OPTIMIZERS)
    assert actions["batch_size"].help.startswith("examples per device per optimizer step")


def test_a_commands_shared_value_is_refused_in_trains_words(cli_here, tmp_path):
    train = cli_here("train", "--batch-size", "0", cwd=tmp_path)
    plan = cli_here("plan", "--batch-size", "0", cwd=tmp_path)
    assert train.returncode == plan.returncode == 2 and train.stderr == plan.stderr
    assert "--batch-size must be > 0, got 0; fix: pass a positive value to --batch-size" in plan.stderr


def test_messages_quote_user_values_within_bounds():
    """A YAML alias bomb or a megabyte flag value: the message is built at once and stays short."""
    from effitrain.errors import LONGEST, UserError

    deep = ["lol"] * 9
    for _ in range(20):  # 9**21 items if expanded
        deep = [deep] * 9
    assert len(cfg.quoted(deep)) < 200 and cfg.quoted("short") == "short"
    with pytest.raises(UserError) as caught:
        cfg.build(None, {"report_to": "x" * 10**6})  # quoted in its message
    assert len(str(caught.value)) < 2 * LONGEST + 20
    err = UserError("p" * 10**6, "f" * 10**6)
    assert len(err.problem) == LONGEST and err.problem.endswith("more characters)") and len(err.fix) == LONGEST


def test_a_yaml_number_in_exponent_form_without_a_dot_is_a_float(tmp_path):
    """PyYAML (YAML 1.1) reads `lr: 2e-5` as the string "2e-5"; `--lr 2e-5` is a float: the file means it too."""
    from effitrain import config

    path = tmp_path / "c.yaml"
    path.write_text("lr: 2e-5\nwarmup_ratio: 1E-1\n")
    assert config.load_yaml(path) == {"lr": 2e-5, "warmup_ratio": 0.1}
    path.write_text("lr: 2e-5x\n")
    with pytest.raises(UserError, match="`lr` must be float or null, got str 2e-5x"):
        config.load_yaml(path)


def test_rewards_are_repeatable_or_a_comma_list_on_the_cli_and_a_list_or_a_text_in_yaml(tmp_path):
    from effitrain.commands.train import configured

    args = build_parser().parse_args(["train", "--task", "causal-lm", "--rl", "grpo", "--reward", "exact-match",
                                      "--reward", "number-match:0.5,ends-turn", "--reward-weights", "1", "0.5", "2"])
    config, _ = configured(args)
    assert config.reward == ["exact-match", "number-match:0.5", "ends-turn"] and config.reward_weights == [1.0, 0.5, 2.0]
    path = tmp_path / "rl.yaml"
    path.write_text("task: causal-lm\nrl: rloo\nreward: exact-match\nreward_weights: [2]\n")
    config, _ = configured(build_parser().parse_args(["train", "--config", str(path)]))
    assert config.reward == ["exact-match"] and config.reward_weights == [2.0]
    with pytest.raises(UserError, match="`reward_weights` must be float"):
        cfg.load_yaml(path.write_text("reward_weights: [one]\n") and path)


def test_online_rl_defaults_follow_the_objective():
    grpo = cfg.build(cli_values={"task": "causal-lm", "rl": "grpo"})
    rloo = cfg.build(cli_values={"task": "causal-lm", "rl": "rloo", "max_new_tokens": 8})
    assert (grpo.scale_rewards, grpo.max_new_tokens, grpo.reward) == ("group", cfg.RL_MAX_NEW_TOKENS, None)
    assert (rloo.scale_rewards, rloo.max_new_tokens) == ("none", 8)
    assert cfg.build().max_new_tokens is None and cfg.build().scale_rewards is None  # no --rl: nothing filled in
