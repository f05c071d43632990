"""On-policy distillation end to end (issue 44, `train --rl distill --distill-from TEACHER`) on the built-in addition
prompts with a tiny Llama student and a 3-layer teacher from configs: 2 processes x 2 prompts x accumulation 2
against one process with 8 (the same weights within 1e-5 fp32, the same logged kl), the teacher's folder untouched
and absent from model/; a run killed mid-way and resumed against one never stopped (bitwise)."""

import hashlib

import effitrain
import pytest
import torch
from test_distributed import torchrun
from test_online_rl import TINY_LLAMA, step_records
from test_resume import kill_when, train

from conftest import as_flags, read_weights


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    """A 3-layer causal LM (random weights, a seed of its own) with the student's tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from effitrain.models import loading

    folder = tmp_path_factory.mktemp("teacher")
    tokenizer = loading.load_text_tokenizer(loading.resolve_source(TINY_LLAMA))
    torch.manual_seed(11)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=3,
                                         num_attention_heads=2, num_key_value_heads=2, intermediate_size=64,
                                         max_position_embeddings=64, initializer_range=0.2))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def digest(folder) -> str:
    hashed = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        hashed.update(path.name.encode() + path.read_bytes())
    return hashed.hexdigest()


def settings(teacher, **more) -> dict:
    return {**dict(model=TINY_LLAMA, task="causal-lm", data="addition", rl="distill", distill_from=str(teacher),
                   distill_beta=0.5, num_generations=4, max_new_tokens=4, max_train_samples=18, max_eval_samples=8,
                   epochs=1, lr=2e-3, warmup_ratio=0.0, log_every=1, precision="fp32", eval_batch_size=4), **more}


@pytest.mark.slow
def test_two_processes_and_accumulation_equal_one_big_batch(tmp_path, teacher):
    """18 prompts: steps of 8, 8 and 2 (the last: the second process runs the stand-in)."""
    before = digest(teacher)
    result = torchrun(2, "train", *as_flags(settings(teacher)), "--batch-size", 2, "--grad-accum", 2,
                      "--output-dir", tmp_path / "ddp-run")
    assert result.returncode == 0, result.stderr[-3000:]
    effitrain.train({**settings(teacher), "batch_size": 8, "output_dir": str(tmp_path / "one-run")})
    single, weights = read_weights(tmp_path / "one-run"), read_weights(tmp_path / "ddp-run")
    assert set(single) == set(weights) and not any("layers.2." in name for name in single)  # the student's alone
    for name in single:
        torch.testing.assert_close(weights[name], single[name], rtol=1e-5, atol=1e-5)
    got, wanted = step_records(tmp_path / "ddp-run"), step_records(tmp_path / "one-run")
    assert len(got) == len(wanted) == 3
    for mine, theirs in zip(got, wanted):
        for key in ("loss", "kl", "completion_length", "truncated_share"):
            assert mine[key] == pytest.approx(theirs[key], rel=1e-5, abs=1e-7), key
        assert mine["kl"] == pytest.approx(mine["loss"], rel=1e-5) and mine["kl"] > 0  # the loss: kl per token
    assert digest(teacher) == before


@pytest.mark.slow
def test_killed_after_step_3_and_resumed_equals_uninterrupted(tmp_path, teacher, cli_here):
    common = as_flags(settings(teacher, max_steps=6, save_every=3, seed=3, batch_size=2, distill_beta=1.0))
    straight = cli_here("train", *common, "--output-dir", tmp_path / "straight")
    assert straight.returncode == 0, straight.stderr[-3000:]
    out = tmp_path / "killed"
    job = train(*common, "--output-dir", out)
    kill_when(job, (out / "checkpoints" / "step-3" / "trainer_state.json").is_file, seconds=240)
    resumed = cli_here("train", *common, "--output-dir", out, "--resume", "auto")
    assert resumed.returncode == 0 and "resumed from" in resumed.stdout, resumed.stderr[-3000:]
    wanted, got = read_weights(tmp_path / "straight"), read_weights(out)
    assert all(torch.equal(wanted[name], got[name]) for name in wanted)
    assert [r["kl"] for r in step_records(out)][-3:] == [r["kl"] for r in step_records(tmp_path / "straight")][-3:]
