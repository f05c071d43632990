"""What a resume does with each setting, as the fields of TrainConfig declare it (`resume="must_match"` or
`resume="free"`): a new field fails here until its author decides, and engine/checkpoint.py refuses a
checkpoint made with another value of exactly the must-match ones. Reads a trainer_state.json written
here; loads no model."""

from __future__ import annotations

import json

import pytest
from effitrain import config as cfg
from effitrain.engine import checkpoint
from effitrain.errors import UserError

MUST_MATCH = [f.name for f in cfg.fields() if f.metadata.get("resume") == "must_match"]
FREE = [f.name for f in cfg.fields() if f.metadata.get("resume") == "free"]


def test_every_field_says_whether_a_resume_must_match_it():
    undecided = [f.name for f in cfg.fields() if f.metadata.get("resume") not in ("must_match", "free")]
    assert not undecided, f"declare resume=\"must_match\" or resume=\"free\" on these fields (config.py): {undecided}"
    later = [f.name for f in cfg.fields() if f.metadata.get("added_later")]
    assert set(later) <= set(MUST_MATCH), "added_later says what an older checkpoint was made with: must-match only"


def test_the_checkpoint_compares_the_declared_fields_peft_first():
    assert set(checkpoint.MUST_MATCH) == set(MUST_MATCH) and len(checkpoint.MUST_MATCH) == len(MUST_MATCH)
    assert checkpoint.MUST_MATCH[0] == "peft"  # its default lr follows from it: named before lr
    assert checkpoint.EARLIER_DEFAULTS == {f.name: f.default for f in cfg.fields() if f.metadata.get("added_later")}


def made(tmp_path, **changed):
    """A checkpoint folder of a run with train's defaults (resolved), on one process."""
    config = cfg.resolved(cfg.TrainConfig(**changed)).to_dict()
    (tmp_path / "trainer_state.json").write_text(json.dumps({"config": config, "world_size": 1, "step": 2}))
    return tmp_path, config


@pytest.mark.parametrize("name", MUST_MATCH)
def test_a_must_match_setting_of_another_value_is_refused(tmp_path, name):
    path, config = made(tmp_path)
    with pytest.raises(UserError) as err:
        checkpoint.check(path, {**config, name: "another value"}, 1, config["grad_accum"])
    assert f"was made with {name}={config[name]!r}, this run has 'another value'" in err.value.problem


@pytest.mark.parametrize("name", [name for name in FREE if name != "batch_size"])
def test_a_free_setting_may_change(tmp_path, name):
    path, config = made(tmp_path)
    assert checkpoint.check(path, {**config, name: "another value"}, 1, config["grad_accum"])["step"] == 2


def test_the_micro_batch_may_change_with_the_examples_per_step_kept(tmp_path):
    path, config = made(tmp_path)
    assert checkpoint.check(path, {**config, "batch_size": config["batch_size"] // 2}, 1, 2)["step"] == 2


def test_a_checkpoint_older_than_a_setting_was_made_with_its_default(tmp_path):
    path, config = made(tmp_path)
    older = {name: value for name, value in config.items() if name not in checkpoint.EARLIER_DEFAULTS}
    (path / "trainer_state.json").write_text(json.dumps({"config": older, "world_size": 1, "step": 2}))
    assert checkpoint.check(path, config, 1, config["grad_accum"])["step"] == 2
    with pytest.raises(UserError, match="was made with peft='none', this run has 'lora'"):
        checkpoint.check(path, {**config, "peft": "lora", "lr": 0.5}, 1, config["grad_accum"])


def test_a_free_setting_that_decides_online_rl_must_match_with_rl(tmp_path):
    """--max-new-tokens is evaluation's alone in SFT (free), the length of every trained completion with --rl."""
    assert checkpoint.MUST_MATCH_WITH == {"max_new_tokens": "rl"}
    path, config = made(tmp_path, task="causal-lm", rl="grpo")
    assert config["max_new_tokens"] == cfg.RL_MAX_NEW_TOKENS
    with pytest.raises(UserError, match="was made with max_new_tokens=64, this run has 8"):
        checkpoint.check(path, {**config, "max_new_tokens": 8}, 1, config["grad_accum"])
    (tmp_path / "sft").mkdir()
    sft, sft_config = made(tmp_path / "sft", task="causal-lm")
    assert checkpoint.check(sft, {**sft_config, "max_new_tokens": 8}, 1, sft_config["grad_accum"])["step"] == 2
