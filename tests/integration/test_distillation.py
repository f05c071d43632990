"""--distill-from: the loss and its gradient against a hand computation, the stored teacher logits against the
teacher's own forward, and a resume that reads them back instead of running the teacher again."""

import shutil

import pytest
import torch
import torch.nn.functional as F
from effitrain.errors import UserError
from effitrain.tasks import distillation

from conftest import read_weights, tiny_bert


@pytest.fixture(scope="module")
def teacher_dir(tiny_model_dir, tmp_path_factory):
    """A tiny BERT of other weights than the student's (seed 1), saved with sms-spam's labels."""
    from transformers import BertForSequenceClassification

    path = tmp_path_factory.mktemp("teacher")
    torch.manual_seed(1)
    model = BertForSequenceClassification.from_pretrained(tiny_model_dir, id2label={0: "ham", 1: "spam"},
                                                          label2id={"ham": 0, "spam": 1})
    for parameter in model.parameters():
        parameter.data.normal_(0, 0.2)
    model.save_pretrained(path)
    shutil.copy(tiny_model_dir / "tokenizer.json", path)
    shutil.copy(tiny_model_dir / "tokenizer_config.json", path)
    for extra in ("vocab.txt", "special_tokens_map.json"):
        if (tiny_model_dir / extra).is_file():
            shutil.copy(tiny_model_dir / extra, path)
    return path


def hand_loss(student, labels, teacher, alpha, temperature):
    """Written out from the definition, one example at a time, in float64."""
    total = 0.0
    for z, y, t in zip(student.double(), labels, teacher.double()):
        p = torch.softmax(z, -1)
        cross_entropy = -torch.log(p[y])
        q_teacher, q_student = torch.softmax(t / temperature, -1), torch.softmax(z / temperature, -1)
        kl = (q_teacher * (q_teacher.log() - q_student.log())).sum()
        total += (1 - alpha) * cross_entropy + alpha * temperature ** 2 * kl
    return total


def hand_gradient(student, labels, teacher, alpha, temperature):
    """d loss / d student logits: (1 - a)(softmax(z) - onehot(y)) + a T (softmax(z / T) - softmax(t / T))."""
    onehot = F.one_hot(labels, student.shape[-1]).double()
    return ((1 - alpha) * (torch.softmax(student.double(), -1) - onehot)
            + alpha * temperature * (torch.softmax(student.double() / temperature, -1)
                                     - torch.softmax(teacher.double() / temperature, -1)))


@pytest.mark.parametrize("alpha, temperature", [(0.0, 2.0), (1.0, 2.0), (0.3, 3.5), (0.5, 0.7)])
def test_the_loss_and_its_gradient_equal_a_hand_computation(alpha, temperature):
    torch.manual_seed(0)
    student = torch.randn(5, 4, requires_grad=True)
    teacher, labels = torch.randn(5, 4) * 3, torch.tensor([0, 3, 1, 1, 2])
    loss = distillation.loss_sum(student, labels, teacher, alpha, temperature)
    loss.backward()
    hand = hand_loss(student.detach(), labels, teacher, alpha, temperature)
    assert float(loss.detach()) == pytest.approx(float(hand), rel=1e-6)
    torch.testing.assert_close(student.grad.double(), hand_gradient(student.detach(), labels, teacher, alpha,
                                                                    temperature), rtol=1e-5, atol=1e-6)
    if alpha == 0.0:  # plain cross-entropy
        assert float(loss.detach()) == pytest.approx(float(F.cross_entropy(student.detach(), labels, reduction="sum")),
                                                     rel=1e-6)
    if alpha == 1.0:  # the KL alone, times T^2
        kl = F.kl_div(F.log_softmax(student / temperature, -1), F.log_softmax(teacher / temperature, -1),
                      reduction="sum", log_target=True)
        assert float(loss.detach()) == pytest.approx(float(kl.detach()) * temperature ** 2, rel=1e-5)


def test_the_task_loss_of_a_tiny_model_and_its_gradient_equal_the_hand_computation():
    """Through Classification.loss_sum on a tiny BERT: the teacher logits ride in the batch, not into the
    model; each example's term summed (a micro-batch split in two sums to the same)."""
    from effitrain import tasks
    from effitrain.tasks.distillation import Distillation

    task = tasks.get("sequence-classification").with_distillation(Distillation("unused", 0.4, 2.5))
    model = tiny_bert()
    ids = torch.randint(5, 100, (4, 7))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.tensor([0, 1, 1, 0]),
             "teacher_logits": torch.randn(4, 2) * 2}
    loss = task.loss_sum(model, batch)
    loss.backward()
    got = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    logits = model(input_ids=ids, attention_mask=batch["attention_mask"]).logits
    hand = hand_loss(logits, batch["labels"], batch["teacher_logits"], 0.4, 2.5)
    assert float(loss.detach()) == pytest.approx(float(hand.detach()), rel=1e-5)
    hand.backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(got[name], p.grad, rtol=1e-4, atol=1e-6)
    halves = [{k: v[:2] for k, v in batch.items()}, {k: v[2:] for k, v in batch.items()}]
    assert float(sum(task.loss_sum(model, half) for half in halves)) == pytest.approx(float(loss), rel=1e-5)


def test_the_packer_keeps_each_examples_teacher_logits_beside_its_label():
    from effitrain.data.packing import ClassificationPacker

    features = [{"input_ids": [101, 5 + i] + [7] * i, "attention_mask": [1] * (2 + i), "labels": i % 2,
                 "teacher_logits": [float(i), -float(i)]} for i in range(5)]
    batch = ClassificationPacker(0, 8)(features)
    # Each example's label and logits stay together, whatever rows first-fit put them in.
    assert [int(t[0]) % 2 for t in batch["teacher_logits"]] == batch["labels"].tolist()
    assert sorted(batch["teacher_logits"][:, 0].tolist()) == [0.0, 1.0, 2.0, 3.0, 4.0]


def test_the_stored_logits_are_the_teachers_forward_and_a_resume_reads_them_back(teacher_dir, tmp_path, tokenizer):
    from datasets import Dataset, DatasetDict
    from effitrain import tasks
    from effitrain.data import text
    from effitrain.tasks.distillation import Distillation
    from transformers import AutoModelForSequenceClassification

    texts = ["free prize now", "see you at noon", "call me", "win cash today!!", "ok", "lunch?", "urgent reply"]
    split = Dataset.from_dict({"text": texts, "label": [1, 0, 0, 1, 0, 0, 1]})
    encoded = text.tokenize(DatasetDict({"train": split, "validation": split.select([0, 1])}), tokenizer, 32,
                            labels=True)
    task = tasks.get("sequence-classification").with_distillation(Distillation(str(teacher_dir)))
    student = tiny_bert(vocab_size=tokenizer.vocab_size, id2label={0: "ham", 1: "spam"},
                        label2id={"ham": 0, "spam": 1})
    _, collate = task.collators(tokenizer, None)
    out = task.distillation.prepare(task, student, encoded, tokenizer, collate, 3, tmp_path)
    teacher = AutoModelForSequenceClassification.from_pretrained(teacher_dir).eval()
    with torch.no_grad():
        for row in out["train"]:
            one = {key: torch.tensor([row[key]]) for key in ("input_ids", "attention_mask")}
            torch.testing.assert_close(torch.tensor(row["teacher_logits"]), teacher(**one).logits[0],
                                       rtol=1e-5, atol=1e-5)
    assert "teacher_logits" not in out["validation"].column_names
    stored = (tmp_path / distillation.FILE).read_bytes()

    def no_teacher(*args, **kwargs):
        raise AssertionError("the teacher ran on resume")

    import effitrain.tasks.distillation as module

    real = module.compute_logits
    module.compute_logits = no_teacher
    try:
        again = task.distillation.prepare(task, student, encoded, tokenizer, collate, 3, tmp_path, resuming=True)
    finally:
        module.compute_logits = real
    assert again["train"]["teacher_logits"] == out["train"]["teacher_logits"]
    assert (tmp_path / distillation.FILE).read_bytes() == stored
    # Other training data than the stored logits were made from: refused.
    other = DatasetDict({**encoded, "train": encoded["train"].select([1, 0, 2, 3, 4, 5, 6])})
    with pytest.raises(UserError, match="another teacher folder or other training data"):
        task.distillation.prepare(task, student, other, tokenizer, collate, 3, tmp_path, resuming=True)


@pytest.fixture
def counted_teacher(monkeypatch):
    """How many times the teacher ran over the training split."""
    calls = []
    real = distillation.compute_logits

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(distillation, "compute_logits", counting)
    return calls


def run_args(tiny_model_dir, teacher_dir, out, batch: list | None = None):
    return ["--model", tiny_model_dir, "--distill-from", teacher_dir, "--distill-alpha", "0.7",
            "--distill-temperature", "3", "--max-train-samples", 24, "--max-eval-samples", 8,
            *(batch or ["--batch-size", 4]),
            "--max-steps", 4, "--save-every", 2, "--log-every", 1, "--precision", "fp32", "--lr", "1e-3",
            "--output-dir", out]


def test_the_flags_reach_the_tasks_distillation(teacher_dir):
    """--distill-alpha and --distill-temperature are the loss's (the loss itself: the hand computations above)."""
    from effitrain import tasks
    from effitrain.config import TrainConfig
    from effitrain.tasks.distillation import Distillation

    config = TrainConfig(distill_from=str(teacher_dir), distill_alpha=0.7, distill_temperature=3.0)
    assert tasks.for_config(config).distillation == Distillation(str(teacher_dir), 0.7, 3.0)


# The exact runs: a 1-layer student of the 2-layer model distilled from the teacher, 64 examples, 12 steps of 16.
EXACT = ["--student-layers", 1, "--distill-alpha", 0.7, "--distill-temperature", 3, "--max-train-samples", 64,
         "--max-eval-samples", 8, "--eval-batch-size", 8, "--max-steps", 12, "--save-every", 3, "--log-every", 1,
         "--precision", "fp32", "--lr", "1e-3", "--no-group-by-length", "--seed", 5]


def exact_args(tiny_model_dir, teacher_dir, *layout) -> list[str]:
    return [str(a) for a in ["--model", tiny_model_dir, "--distill-from", teacher_dir, *EXACT, *layout]]


@pytest.fixture(scope="module")
def one_batch_of_16(tiny_model_dir, teacher_dir, tmp_path_factory):
    """The run never stopped, 1 process x 16, in this process (and its first line)."""
    import contextlib
    import io

    from effitrain.cli import main

    out = tmp_path_factory.mktemp("single") / "run"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = main(["train", *exact_args(tiny_model_dir, teacher_dir, "--batch-size", 16), "--output-dir", str(out)])
    assert code == 0
    return out, printed.getvalue()


def test_the_first_line_names_the_teacher_beside_the_student(one_batch_of_16, teacher_dir):
    first = next(line for line in one_batch_of_16[1].splitlines() if line.startswith("training "))
    assert f"a student of 1 layers, distilled from {teacher_dir} (alpha 0.7, T 3)" in first, first


def stored_logits(out):
    from safetensors import safe_open

    with safe_open(str(out / distillation.FILE), framework="pt") as stored:
        return stored.get_tensor("logits"), stored.metadata()


def test_two_processes_x_4_x_accumulation_2_equal_one_process_x_16(tiny_model_dir, teacher_dir, tmp_path,
                                                                   one_batch_of_16):
    """The teacher's logits computed by the 2 processes (each every 2nd example) then gathered are the single
    process's, in the data's order; the trained weights and the test loss are 1 x 16's (fp32, 1e-5)."""
    from test_distributed import torchrun

    single = one_batch_of_16[0]
    result = torchrun(2, "train", *exact_args(tiny_model_dir, teacher_dir, "--batch-size", 4, "--grad-accum", 2),
                      "--output-dir", tmp_path / "ddp")
    assert result.returncode == 0, result.stderr[-3000:]
    (theirs, their_meta), (ours, our_meta) = stored_logits(tmp_path / "ddp"), stored_logits(single)
    assert theirs.shape == ours.shape == (64, 2) and their_meta[distillation.FINGERPRINT] == \
        our_meta[distillation.FINGERPRINT]
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)
    wanted, got = read_weights(single), read_weights(tmp_path / "ddp")
    assert wanted.keys() == got.keys() and len([k for k in got if ".layer." in k]) > 0
    assert not any(".layer.1." in k for k in got)  # the student: one layer
    for name in wanted:
        torch.testing.assert_close(got[name], wanted[name], rtol=1e-5, atol=1e-5)
    import json

    runs = [json.loads((d / "metrics.json").read_text()) for d in (single, tmp_path / "ddp")]
    assert runs[1]["world_size"] == 2 and runs[1]["steps"] == runs[0]["steps"] == 12
    assert runs[1]["test"]["loss"] == pytest.approx(runs[0]["test"]["loss"], rel=1e-5)


def test_a_run_killed_after_a_checkpoint_resumes_bitwise_without_the_teacher(tiny_model_dir, teacher_dir, tmp_path,
                                                                             one_batch_of_16, cli_here, monkeypatch):
    """SIGKILLed once its step-3 checkpoint is written, resumed with the teacher's loading made to fail: the
    stored logits are read back (the file untouched) and the weights end bitwise those of the run never stopped."""
    from test_resume import kill_when, read_log, train

    args = exact_args(tiny_model_dir, teacher_dir, "--batch-size", 16)
    out = tmp_path / "killed"
    job = train(*args, "--output-dir", out)  # a process of its own, to be killed
    kill_when(job, lambda: any(r.get("step", 0) >= 4 for r in read_log(out)))
    assert not (out / "metrics.json").exists() and (out / "checkpoints" / "step-3").is_dir()
    path = out / distillation.FILE
    before = (path.read_bytes(), path.stat().st_mtime_ns)

    def no_teacher(*args, **kwargs):
        raise AssertionError("the teacher was loaded or run on resume")

    monkeypatch.setattr(distillation.Distillation, "load_teacher", no_teacher)
    monkeypatch.setattr(distillation, "compute_logits", no_teacher)
    resumed = cli_here("train", *args, "--output-dir", out, "--resume", "auto")
    assert resumed.returncode == 0 and "resumed from" in resumed.stdout, resumed.stderr[-3000:]
    assert (path.read_bytes(), path.stat().st_mtime_ns) == before
    wanted, got = read_weights(one_batch_of_16[0]), read_weights(out)
    assert wanted.keys() == got.keys() and all(torch.equal(wanted[name], got[name]) for name in wanted)


@pytest.mark.parametrize("damage", ["deleted", "edited"])
def test_a_stored_file_deleted_or_altered_before_resume_is_refused(tiny_model_dir, teacher_dir, tmp_path, cli_here,
                                                                   damage):
    out = tmp_path / "run"
    first = cli_here("train", *run_args(tiny_model_dir, teacher_dir, out))
    assert first.returncode == 0, first.stderr[-3000:]
    (out / "metrics.json").unlink()
    path = out / distillation.FILE
    if damage == "deleted":
        path.unlink()
    else:
        data = bytearray(path.read_bytes())
        data[-1] ^= 0x10
        path.write_bytes(bytes(data))
    result = cli_here("train", *run_args(tiny_model_dir, teacher_dir, out), "--resume", "auto")
    assert result.returncode == 2, result.stderr[-3000:]
    line = result.stderr.strip().splitlines()[-1]
    assert "teacher's stored logits" in line and ("is missing" if damage == "deleted" else "digest differs") in line


@pytest.mark.parametrize("layout", [["--batch-size", "4", "--grad-accum", "2"], ["--batch-size", "8", "--packing"]])
def test_accumulation_and_packing_equal_one_padded_micro_batch(tiny_model_dir, teacher_dir, tmp_path, cli_here,
                                                               layout):
    """Each example's term is summed and the step divides by its examples: 4 x accumulation 2, and packed rows
    (each example's logits beside its label), end with the weights of 1 x 8 (fp32, 1e-5)."""
    def run(name, *more):
        result = cli_here("train", *run_args(tiny_model_dir, teacher_dir, tmp_path / name, list(more)),
                          "--no-group-by-length")
        assert result.returncode == 0, result.stderr[-3000:]
        return read_weights(tmp_path / name)

    wanted, got = run("whole", "--batch-size", "8"), run("other", *layout)
    for name in wanted:
        torch.testing.assert_close(got[name], wanted[name], rtol=1e-5, atol=1e-5)
