"""Preference tuning (issue 30): DPO and ORPO losses against a hand computation from the model's
log-probs, the three reference modes against each other, 2 processes x 4 x accumulation 2 against one
batch of 16, a killed and resumed run against one never stopped, and the data formats."""

import json

import effitrain
import pytest
import torch
import torch.nn.functional as F
from effitrain.data import preferences
from effitrain.errors import UserError
from effitrain.speedups import chunked_lm_loss
from effitrain.tasks import preference
from test_distributed import torchrun
from test_resume import kill_when, train

from conftest import as_flags, read_jsonl, read_weights

TINY_LLAMA = ("llama:hidden_size=32,num_hidden_layers=2,num_attention_heads=2,num_key_value_heads=2,"
              "intermediate_size=64,max_position_embeddings=256")


def write_pairs(folder, count: int = 48) -> str:
    """Prompt/chosen/rejected strings whose answers differ in length, so that micro-batches hold different
    numbers of tokens (ORPO's NLL is a mean over them)."""
    path = folder / "pairs.jsonl"
    rows = [{"prompt": f"Is {n} even? " * (1 + n % 3), "chosen": " ".join([["yes", "no"][n % 2]] * (1 + n % 4)),
             "rejected": " ".join([["no", "yes"][n % 2]] * (1 + n % 2))} for n in range(count)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                         num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64))
    assert chunked_lm_loss.apply(model)
    return model.eval()


def pair_batch(pairs: int = 3, width: int = 12) -> dict:
    """[pairs, 2, width] ids; each sequence a prompt then an answer of its own length, then padding."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 50, (pairs, 2, width), generator=generator)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for p in range(pairs):
        for side in range(2):
            prompt, end = 3 + p, 6 + p + 2 * side + (p % 2)
            mask[p, side, :end] = 1
            labels[p, side, prompt:end] = ids[p, side, prompt:end]
    return {"input_ids": ids, "attention_mask": mask, "labels": labels,
            "reference_logps": -torch.rand(pairs, 2, generator=generator, dtype=torch.float64) * 20}


def preference_task(kind: str, **settings):
    """The preference task as a run builds it (tasks.for_config), with the objective `kind`."""
    from effitrain import tasks
    from effitrain.config import TrainConfig

    return tasks.for_config(TrainConfig(task="causal-lm", preference=kind, **settings))


def hand_logps(model, batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From the whole logits: each position's log-prob of the next token, [pairs, 2, width - 1], and the
    answer and real-token masks of the targets."""
    ids, mask = batch["input_ids"].flatten(0, 1), batch["attention_mask"].flatten(0, 1)
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
    logps = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0].view(*batch["input_ids"].shape[:2], -1)
    return logps, batch["labels"][..., 1:] != -100, batch["attention_mask"][..., 1:].bool()


@pytest.mark.parametrize("loss, smoothing", [("sigmoid", 0.0), ("sigmoid", 0.2), ("ipo", 0.0)])
def test_dpo_loss_equals_a_hand_computation(loss, smoothing):
    model, batch = tiny_llama(), pair_batch()
    task = preference_task("dpo", beta=0.3, reference="precompute", dpo_loss=loss, dpo_label_smoothing=smoothing)
    logps, answers, _ = hand_logps(model, batch)
    policy = (logps * answers).sum(-1)
    ratios = policy - batch["reference_logps"].float()
    if loss == "ipo":
        per_token = ratios / answers.sum(-1)
        wanted = ((per_token[:, 0] - per_token[:, 1] - 1 / 0.6) ** 2).sum()
    else:
        x = 0.3 * (ratios[:, 0] - ratios[:, 1])
        wanted = (-(1 - smoothing) * F.logsigmoid(x) - smoothing * F.logsigmoid(-x)).sum()
    got = task.loss_sum(model, batch)
    torch.testing.assert_close(got, wanted, rtol=1e-6, atol=1e-6)
    assert int(task.item_count(batch)) == 3
    # The gradient through the chunked per-token log-probs is the whole logits' gradient.
    got_grads = torch.autograd.grad(got, list(model.parameters()))
    wanted_grads = torch.autograd.grad(wanted, list(model.parameters()))
    for a, b in zip(got_grads, wanted_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_orpo_loss_equals_a_hand_computation():
    """TRL's ORPO: the chosen sequences' NLL over all their real tokens (a token mean) minus beta x the pair
    mean of log sigmoid(log odds) of the answers' mean log-probs; two terms, two counts."""
    model, batch = tiny_llama(), pair_batch()
    task = preference_task("orpo", beta=0.25)
    logps, answers, real = hand_logps(model, batch)
    nll = -(logps[:, 0] * real[:, 0]).sum()
    mean = (logps * answers).sum(-1) / answers.sum(-1)
    log_odds = (mean[:, 0] - mean[:, 1]) - (torch.log1p(-mean[:, 0].exp()) - torch.log1p(-mean[:, 1].exp()))
    got = task.loss_sum(model, batch)
    torch.testing.assert_close(got, torch.stack([nll, -0.25 * F.logsigmoid(log_odds).sum()]), rtol=1e-6, atol=1e-6)
    assert task.item_count(batch).tolist() == [int(real[:, 0].sum()), 3]
    step_loss = (got / task.item_count(batch)).sum()  # one micro-batch: TRL's loss
    torch.testing.assert_close(step_loss, nll / real[:, 0].sum() - 0.25 * F.logsigmoid(log_odds).mean(),
                               rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", ["dpo", "orpo"])
def test_the_step_logs_the_rewards_and_accuracy_evaluation_computes(kind):
    """The sums train_loss returns with the loss for the step's log line (rewards of each answer, margin, pairs
    ranked right, ORPO's log-odds term; then the pairs) are those the evaluation's metrics make of the same
    batch."""
    model, batch = tiny_llama(), pair_batch(pairs=5)
    task = preference_task(kind, beta=0.3, reference="precompute")  # orpo has no reference: ignored
    batch["reference_logps"][1] = task.answer_logps(model, {k: v[1:2] for k, v in batch.items()})[0].double()
    batch["reference_logps"][1, 0] -= 1.0  # a pair ranked right, the others wrong or right by chance
    loss, sums = task.train_loss(model, batch)
    torch.testing.assert_close(loss, task.loss_sum(model, batch))
    names = task.train_metric_names()
    assert len(sums) == len(names) + 1 and sums[-1] == 5
    with torch.no_grad():
        wanted = task.metrics(task.eval_outputs(model, batch), None)
    got = dict(zip(names, (sums[:-1] / sums[-1]).tolist()))
    assert set(got) == set(wanted) - {"loss", "nll", "samples"}
    assert got == pytest.approx({name: wanted[name] for name in got}, abs=1e-6)
    assert 0 < got["preference_accuracy"] < 1


def run_losses(folder) -> list[float]:
    return [r["loss"] for r in read_jsonl(folder / "log.jsonl") if "split" not in r and "loss" in r]


def run_step_metrics(folder) -> list[list[float]]:
    """The preference numbers of every logged step."""
    return [[r[name] for name in preference.Preference.METRICS[1:]]
            for r in read_jsonl(folder / "log.jsonl") if "split" not in r and "loss" in r]


@pytest.mark.parametrize("peft, modes", [("lora", ("adapters", "precompute", "copy")), ("none", ("precompute", "copy"))])
def test_reference_modes_give_the_same_losses(tmp_path, peft, modes):
    """The reference log-probs precomputed, from a frozen copy, and from the adapters switched off: the same
    losses at every step and the same validation metrics (fp32)."""
    common = dict(model=TINY_LLAMA, task="causal-lm", data=write_pairs(tmp_path, 32), preference="dpo", batch_size=4,
                  max_steps=3, lr=1e-2, log_every=1, max_length=64, precision="fp32", peft=peft, eval_batch_size=5)
    results = {}
    for mode in modes:
        effitrain.train({**common, "reference": mode, "output_dir": str(tmp_path / mode)})
        results[mode] = (run_losses(tmp_path / mode), json.loads((tmp_path / mode / "metrics.json").read_text()))
    first, (losses, metrics) = modes[0], results[modes[0]]
    assert losses[0] == pytest.approx(0.6931472, abs=1e-6)  # the policy starts as its reference
    assert len(set(losses)) > 1  # it trained
    steps = run_step_metrics(tmp_path / first)
    assert steps[0] == pytest.approx([0.0, 0.0, 0.0, 0.0], abs=1e-6)  # rewards are 0 where policy = reference
    for mode in modes[1:]:
        assert results[mode][0] == pytest.approx(losses, abs=1e-5), mode
        assert [v for step in run_step_metrics(tmp_path / mode) for v in step] == \
            pytest.approx([v for step in steps for v in step], abs=1e-5), mode
        for key in preference.Preference.METRICS:
            assert results[mode][1]["validation"][key] == pytest.approx(metrics["validation"][key], abs=1e-5), mode
    assert (tmp_path / "precompute" / "reference_logps.safetensors").is_file()
    assert not (tmp_path / first / "reference_logps.safetensors").is_file() or first == "precompute"


@pytest.mark.slow
@pytest.mark.parametrize("kind, adapters", [("dpo", False), ("orpo", False), ("dpo", True)])
def test_two_processes_and_accumulation_equal_one_big_batch(tmp_path, kind, adapters):
    """2 processes x 4 pairs x accumulation 2 against 1 x 16 (and 1 x 4 x 4): the same weights and losses;
    36 pairs, so the last step of each epoch is short and one process runs a zero-weight stand-in. With
    LoRA the reference is the DDP-wrapped model with its adapters switched off."""
    common = dict(model=TINY_LLAMA, task="causal-lm", data=write_pairs(tmp_path, 60), preference=kind,
                  max_train_samples=36, max_eval_samples=10, epochs=2, lr=2e-3, warmup_ratio=0.0, log_every=1,
                  max_length=64, precision="fp32", eval_batch_size=4)
    if adapters:
        common.update(peft="lora", lora_dropout=0.0)  # dropout masks would differ with the layout
    result = torchrun(2, "train", *as_flags(common), "--batch-size", 4, "--grad-accum", 2,
                      "--output-dir", tmp_path / "ddp")
    assert result.returncode == 0, result.stderr[-3000:]
    effitrain.train({**common, "batch_size": 4, "grad_accum": 4, "output_dir": str(tmp_path / "accum")})
    effitrain.train({**common, "batch_size": 16, "output_dir": str(tmp_path / "single")})
    # AdamW turns float noise in a near-zero gradient into a step of about lr: weights compared to 1e-5
    # absolute at this lr, the losses to 1e-5 relative.
    single = read_weights(tmp_path / "single")
    for other in ("ddp", "accum"):
        weights = read_weights(tmp_path / other)
        for name in single:
            torch.testing.assert_close(weights[name], single[name], rtol=1e-5, atol=1e-5)
        assert run_losses(tmp_path / other) == pytest.approx(run_losses(tmp_path / "single"), rel=1e-5)
        # The step's rewards and accuracy: sums over every pair of the step, whatever the layout. At the first
        # step the policy is its reference: every pair ties, and float noise (the reference's batches differ
        # with the processes) ranks a few either way, so its accuracy is not compared.
        got, wanted = run_step_metrics(tmp_path / other), run_step_metrics(tmp_path / "single")
        got[0][3] = wanted[0][3] = 0.0
        assert [v for step in got for v in step] == pytest.approx([v for step in wanted for v in step], rel=1e-5, abs=1e-6)
        metrics = json.loads((tmp_path / other / "metrics.json").read_text())["validation"]
        wanted = json.loads((tmp_path / "single" / "metrics.json").read_text())["validation"]
        assert metrics["samples"] == wanted["samples"] == 6  # gathered without duplicates
        assert metrics["loss"] == pytest.approx(wanted["loss"], rel=1e-5)


@pytest.mark.slow
def test_killed_after_step_5_and_resumed_equals_uninterrupted(tmp_path, cli_here):
    """DPO with the precomputed reference and LoRA dropout (the RNG restored too): the resumed run reads the
    reference log-probs back from the run folder and ends with the very weights of the run never stopped."""
    common = ["--model", TINY_LLAMA, "--task", "causal-lm", "--data", write_pairs(tmp_path), "--preference", "dpo",
              "--reference", "precompute", "--peft", "lora", "--batch-size", 4, "--max-steps", 10,
              "--max-length", 64, "--log-every", 1, "--save-every", 5, "--precision", "fp32", "--seed", 3]
    straight = cli_here("train", *common, "--output-dir", tmp_path / "straight")
    assert straight.returncode == 0, straight.stderr[-3000:]
    out = tmp_path / "killed"
    job = train(*common, "--output-dir", out)
    kill_when(job, (out / "checkpoints" / "step-5" / "trainer_state.json").is_file, seconds=240)
    stored = (out / "reference_logps.safetensors").stat().st_mtime_ns
    resumed = cli_here("train", *common, "--output-dir", out, "--resume", "auto")
    assert resumed.returncode == 0 and "resumed from" in resumed.stdout, resumed.stderr[-3000:]
    assert (out / "reference_logps.safetensors").stat().st_mtime_ns == stored  # read back, not recomputed
    wanted, got = read_weights(tmp_path / "straight"), read_weights(out)
    assert all(torch.equal(wanted[name], got[name]) for name in wanted)


# -- data formats -------------------------------------------------------------------------------------
def test_formats_are_told_apart_and_the_implicit_prompt_is_the_shared_start():
    from datasets import Dataset

    strings = Dataset.from_list([{"prompt": "p", "chosen": "a", "rejected": "b"}])
    messages = Dataset.from_list([{"prompt": [{"role": "user", "content": "p"}],
                                   "chosen": [{"role": "assistant", "content": "a"}],
                                   "rejected": [{"role": "assistant", "content": "b"}]}])
    user = {"role": "user", "content": "p"}
    conversations = Dataset.from_list([{"chosen": [user, {"role": "assistant", "content": "a"}],
                                        "rejected": [user, {"role": "assistant", "content": "b"}]}])
    assert preferences.of_data(strings) == preferences.STRINGS
    assert preferences.of_data(messages) == preferences.MESSAGES
    assert preferences.of_data(conversations) == preferences.CONVERSATIONS
    chosen, rejected, _ = preferences.as_sft(conversations[0], preferences.CONVERSATIONS)
    assert chosen["prompt"] == rejected["prompt"] == [user]
    assert chosen["completion"] == [{"role": "assistant", "content": "a"}]


def test_pairs_are_encoded_as_sft_encodes_prompt_completion(tokenizer):
    """Each side's ids and labels are answers.encode's for the prompt with that answer."""
    from effitrain.data import answers, conversations

    row = {"prompt": "Is it spam?", "chosen": "spam", "rejected": "ham, not spam"}
    pair = preferences.encode(tokenizer, row, preferences.STRINGS, 64)
    for side in ("chosen", "rejected"):
        sft = answers.encode(tokenizer, {"prompt": row["prompt"], "completion": row[side]},
                             conversations.PROMPT_COMPLETION)
        assert pair[f"{side}_input_ids"] == sft.input_ids and pair[f"{side}_labels"] == sft.labels
    batch = preferences.collator(tokenizer.pad_token_id)([pair, pair])
    assert batch["input_ids"].shape == batch["labels"].shape == (2, 2, len(pair["rejected_input_ids"]))
    assert batch["labels"][0, 0, len(pair["chosen_input_ids"]):].eq(-100).all()


def test_the_planner_counts_two_rows_per_pair_and_what_the_reference_holds():
    """A micro-batch of 4 pairs is planned as SFT's micro-batch of 8 sequences; --reference copy holds the
    weights again, precompute and adapters nothing more."""
    from effitrain.planning import planner as plan

    shapes = plan.model_shapes("causal-lm", TINY_LLAMA + ",vocab_size=500")
    setting = {"precision": "fp32", "optimizer": "adamw", "checkpointing": False, "accumulation": 1}
    sft = plan.Planner(shapes, 32).estimate(plan.Setting(micro_batch=8, **setting))
    for reference, extra in (("precompute", 0), ("copy", shapes.weight_bytes + shapes.buffer_bytes)):
        dpo = plan.Planner(plan.for_preference(shapes, "dpo", reference), 32).estimate(
            plan.Setting(micro_batch=4, **setting))
        assert dpo.activations == sft.activations and dpo.weights == sft.weights + extra


def test_evaluate_with_the_starting_model_as_reference_gives_trains_test_metrics(tmp_path, tokenizer, cli_here):
    """`evaluate --preference dpo --reference-model START` on the run's model/ gives metrics.json's test
    metrics (the reference precomputed the same way); the model as its own reference gives rewards 0."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                 num_key_value_heads=2, intermediate_size=32)).save_pretrained(tmp_path / "start")
    tokenizer.save_pretrained(tmp_path / "start")
    data = write_pairs(tmp_path)
    effitrain.train({"model": str(tmp_path / "start"), "task": "causal-lm", "data": data, "preference": "dpo",
                     "batch_size": 8, "max_steps": 3, "lr": 1e-2, "precision": "fp32", "max_length": 64,
                     "output_dir": str(tmp_path / "run")})
    wanted = json.loads((tmp_path / "run" / "metrics.json").read_text())["test"]
    common = ["evaluate", "--model", tmp_path / "run" / "model", "--data", data, "--preference", "dpo", "--precision",
              "fp32", "--max-length", 64]
    result = cli_here(*common, "--reference-model", tmp_path / "start")
    assert result.returncode == 0, result.stderr[-3000:]
    got = json.loads(result.stdout)
    for key in preference.Preference.METRICS:
        assert got[key] == pytest.approx(wanted[key], abs=1e-5), key
    itself = json.loads(cli_here(*common, "--reference-model", tmp_path / "run" / "model").stdout)
    assert itself["reward_margin"] == 0 and itself["loss"] == pytest.approx(0.6931472)
    import copy
    import shutil

    shutil.copytree(tmp_path / "start", tmp_path / "other")  # the same model, a token more in its vocabulary
    grown = copy.deepcopy(tokenizer)
    grown.add_special_tokens({"extra_special_tokens": ["<|im_end|>"]}, replace_extra_special_tokens=False)
    grown.save_pretrained(tmp_path / "other")
    refused = cli_here(*common, "--reference-model", tmp_path / "other")
    assert refused.returncode == 2 and "has another vocabulary than the model" in refused.stderr, refused.stderr


def test_conversations_with_a_shared_prompt_encode_as_explicit_message_pairs(tokenizer):
    """The implicit prompt (the conversations' common start) gives the ids and labels of the same pair with
    an explicit `prompt`; the labels are the assistant's answer and its end of turn."""
    import copy

    from effitrain.data import templates

    chat = copy.deepcopy(tokenizer)
    templates.install(chat, "chatml")
    prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Is 3 even?"}]
    answers = {side: [{"role": "assistant", "content": text}] for side, text in (("chosen", "no"), ("rejected", "yes"))}
    explicit = preferences.encode(chat, {"prompt": prompt, **answers}, preferences.MESSAGES, 96)
    implicit = preferences.encode(chat, {side: prompt + turns for side, turns in answers.items()},
                                  preferences.CONVERSATIONS, 96)
    assert explicit == implicit
    end = chat.convert_tokens_to_ids("<|im_end|>")
    assert [label for label in explicit["chosen_labels"] if label != -100] == \
        chat("no", add_special_tokens=False)["input_ids"] + [end]


@pytest.mark.parametrize("damage", ["edited", "truncated", "garbage", "no-digest"])
def test_a_stored_reference_that_is_not_what_the_run_wrote_is_refused_on_resume(tmp_path, damage):
    """reference_logps.safetensors carries the digest of its values: a resume never trains against edited,
    cut or foreign log-probs, and says so in one line."""
    from effitrain.tasks import reference
    from safetensors.torch import save_file

    stored = {"train": -torch.rand(6, 2, dtype=torch.float64), "validation": -torch.rand(2, 2, dtype=torch.float64)}
    reference._write(tmp_path, stored)
    sizes = {"train": 6, "validation": 2}
    assert all(torch.equal(reference._read(tmp_path, sizes)[k], stored[k]) for k in stored)
    path = tmp_path / reference.FILE
    if damage == "edited":
        data = bytearray(path.read_bytes())
        data[-1] ^= 0x10  # one bit of the last value
        path.write_bytes(bytes(data))
    elif damage == "truncated":
        path.write_bytes(path.read_bytes()[:-9])
    elif damage == "garbage":
        path.write_bytes(b"\x00garbage" * 20)
    else:
        save_file(stored, str(path))  # the same values, written by something that kept no digest
    with pytest.raises(UserError, match=r"DPO's precomputed reference .* (cannot be read|is not what this run wrote)"
                                        r".*fix: delete it"):
        reference._read(tmp_path, sizes)


def test_conversations_that_differ_before_their_last_answer_are_told_so():
    """The implicit prompt is the two conversations' shared start: differing at a user turn leaves a user turn
    in an answer. Said as that, with the two fixes, not as a completion's rule ("keep only assistant turns")."""
    user, answer = ({"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"})
    pair = {"chosen": [user, answer, {"role": "user", "content": "and you?"}, {"role": "assistant", "content": "fine"}],
            "rejected": [user, answer, {"role": "user", "content": "bye"}, {"role": "assistant", "content": "no"}]}
    problem, fix = preferences.problem_of(pair, preferences.CONVERSATIONS)
    assert problem == ("its chosen and rejected conversations differ from message 3 on, and the chosen one has a "
                       "user turn after that: only the final assistant answer may differ")
    assert "give the pair a `prompt` column" in fix


FAKE_OBJECTIVE = r'''
import contextlib, io, json, sys
from effitrain.catalog.objective_names import ObjectiveName
from effitrain.tasks import objectives
from effitrain.tasks.objectives.orpo import Orpo


class FakeOrpo(Orpo):
    name = "fake-orpo"


objectives.register(FakeOrpo, ObjectiveName("fake-orpo", "a test's own: ORPO's loss under another name"))
from effitrain import cli

shown = io.StringIO()
with contextlib.redirect_stdout(shown), contextlib.suppress(SystemExit):
    cli.main(["train", "--help"])
plans = {}
for name in ("orpo", "fake-orpo"):
    planned = io.StringIO()
    with contextlib.redirect_stdout(planned):
        code = cli.main(["plan", "--model", sys.argv[1], "--task", "causal-lm", "--preference", name, "--seq-len", "64",
                         "--memory", "4GiB", "--json", "--precision", "fp32", "--optim", "adamw"])
    plans[name] = (code, json.loads(planned.getvalue()))
codes = {name: cli.main(["train", "--preference", name, "--output-dir", f"{sys.argv[2]}/{name}", *sys.argv[3:]])
         for name in ("orpo", "fake-orpo")}
print("RESULT", json.dumps({"help": " ".join(shown.getvalue().split()), "plans": plans, "codes": codes}))
'''


def test_a_registered_objective_is_one_that_train_plan_and_help_know(tmp_path):
    """One class and its catalog entry, registered in one call: --help lists it, plan plans it as the
    objective it copies, and train trains it to the same losses (ORPO's arithmetic under another name)."""
    import subprocess
    import sys

    flags = ["--model", TINY_LLAMA, "--task", "causal-lm", "--data", write_pairs(tmp_path, 24), "--batch-size", "4",
             "--max-steps", "2", "--log-every", "1", "--max-length", "64", "--precision", "fp32", "--lr", "1e-2"]
    out = subprocess.run([sys.executable, "-c", FAKE_OBJECTIVE, TINY_LLAMA, str(tmp_path), *flags],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.split("RESULT ", 1)[1])
    assert "fake-orpo (a test's own: ORPO's loss under another name)" in result["help"]
    (code, plan), (fake_code, fake_plan) = result["plans"]["orpo"], result["plans"]["fake-orpo"]
    assert code == fake_code == 0 and [r["total"] for r in fake_plan["rows"]] == [r["total"] for r in plan["rows"]]
    assert result["codes"] == {"orpo": 0, "fake-orpo": 0}
    losses = run_losses(tmp_path / "orpo")
    assert len(losses) == 2 and run_losses(tmp_path / "fake-orpo") == losses
    metrics = json.loads((tmp_path / "fake-orpo" / "metrics.json").read_text())
    assert metrics["test"]["log_odds_ratio"] == json.loads((tmp_path / "orpo" / "metrics.json").read_text())["test"][
        "log_odds_ratio"]
