"""--distill-from with --task causal-lm (tasks/lm_distillation.py): the top-k loss and its gradient against a hand
computation, the stored top-k against the teacher's own forward, packed and padded layouts alike, a resume that
reads the stored file back (the teacher never loaded) and ends bitwise equal, 2 processes x 4 x accumulation 2
equal to 1 x 16, and the stored file deleted or altered before a resume refused."""

import json
import sys

import effitrain
import pytest
import torch
import torch.nn.functional as F
from effitrain.errors import UserError
from effitrain.tasks import distillation, lm_distillation

from conftest import read_weights

sys.path.insert(0, __import__("os").path.dirname(__file__))
from test_distributed import torchrun  # noqa: E402

TEACHER = ("llama:hidden_size=32,num_hidden_layers=2,num_attention_heads=2,num_key_value_heads=2,"
           "intermediate_size=64,max_position_embeddings=256")
STUDENT = ("llama:hidden_size=16,num_hidden_layers=1,num_attention_heads=2,num_key_value_heads=2,"
           "intermediate_size=32,max_position_embeddings=256")


def hand_loss(logits, targets, ids, logps, alpha, temperature):
    """From the definition, one position at a time, in float64: K + 1 buckets (the teacher's K tokens, the rest)."""
    total = torch.zeros((), dtype=torch.float64)
    for z, y, top, teacher in zip(logits.double(), targets, ids, logps.double()):
        cross_entropy = -torch.log_softmax(z, -1)[y]
        q = torch.softmax(z / temperature, -1)
        p = teacher.exp()
        buckets_p, buckets_q = list(p), list(q[top])
        if len(top) < len(z):  # the rest's bucket (none when the K tokens are the whole vocabulary)
            buckets_p, buckets_q = buckets_p + [1 - p.sum()], buckets_q + [1 - q[top].sum()]
        kl = sum(float(a) * (torch.log(a) - torch.log(b)) for a, b in zip(buckets_p, buckets_q) if a > 0)
        total = total + (1 - alpha) * cross_entropy + alpha * temperature ** 2 * kl
    return total


def hand_gradient(logits, targets, ids, logps, alpha, temperature):
    """d loss / d logits: (1 - a)(softmax(z) - onehot) + a T q_j (1 - P_b / Q_b), b the bucket of token j (so
    a T (q_j - p_j) for the K tokens and a T q_j (1 - p_rest / q_rest) for the others)."""
    z = logits.double()
    q = torch.softmax(z / temperature, -1)
    ratio = torch.empty_like(q)
    for row, (top, teacher) in enumerate(zip(ids, logps.double())):
        p = teacher.exp()
        rest_p, rest_q = 1 - p.sum(), 1 - q[row, top].sum()
        ratio[row] = rest_p / rest_q
        ratio[row, top] = p / q[row, top]
    onehot = F.one_hot(targets, z.shape[-1]).double()
    return (1 - alpha) * (torch.softmax(z, -1) - onehot) + alpha * temperature * q * (1 - ratio)


@pytest.mark.parametrize("alpha, temperature, k", [(0.5, 2.0, 3), (1.0, 1.0, 1), (0.0, 2.0, 4), (0.3, 0.7, 11),
                                                   (0.8, 3.5, 11)])
def test_the_loss_and_its_gradient_equal_a_hand_computation(alpha, temperature, k):
    torch.manual_seed(0)
    vocabulary = 11
    logits = (torch.randn(6, vocabulary, dtype=torch.float64) * 2).requires_grad_()
    targets = torch.randint(0, vocabulary, (6,))
    teacher = torch.randn(6, vocabulary, dtype=torch.float64) * 2
    logps, ids = torch.log_softmax(teacher / temperature, -1).topk(k, -1)
    loss = lm_distillation.loss_sum(logits, targets, ids, logps, alpha, temperature)
    loss.backward()
    hand = hand_loss(logits.detach(), targets, ids, logps, alpha, temperature)
    assert float(loss.detach()) == pytest.approx(float(hand), rel=1e-10)
    torch.testing.assert_close(logits.grad, hand_gradient(logits.detach(), targets, ids, logps, alpha, temperature),
                               rtol=1e-9, atol=1e-11)
    if k == vocabulary:  # every token: the full KL, as the classifier's distillation computes it
        full = distillation.loss_sum(logits.detach(), targets, teacher, alpha, temperature)
        assert float(loss.detach()) == pytest.approx(float(full), rel=1e-6)  # that one computes in fp32


def tiny_llama(vocabulary: int, seed: int, hidden: int = 16):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocabulary, hidden_size=hidden, intermediate_size=2 * hidden,
                                        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                                        max_position_embeddings=64)).eval()


def batch_of(rows, top_k, packing=False):
    """Rows (input_ids, labels, the teacher's columns) through the training collator, padded or packed."""
    from effitrain.data import answers, text

    inner = text.packing_collator() if packing else answers.collator(0)
    return lm_distillation.with_teacher_columns(inner, top_k)(rows)


def chat_rows(teacher, top_k, temperature):
    """Three examples with labels on their last tokens (answers), and the teacher's values at those positions."""
    torch.manual_seed(3)
    rows = []
    for length, answer in ((7, 3), (5, 2), (9, 4)):
        ids = torch.randint(5, 40, (length,)).tolist()
        labels = [-100] * (length - answer) + ids[length - answer:]
        with torch.no_grad():
            logits = teacher(input_ids=torch.tensor([ids])).logits[0, :-1][length - answer - 1:]
        logps, top = torch.log_softmax(logits / temperature, -1).topk(top_k, -1)
        rows.append({"input_ids": ids, "labels": labels, lm_distillation.IDS: top.tolist(),
                     lm_distillation.LOGPS: logps.tolist()})
    return rows


@pytest.mark.parametrize("chunked", [False, True])
def test_the_task_loss_of_a_tiny_llama_equals_the_hand_computation_padded_and_packed(chunked):
    """Through CausalLM.loss_sum: the teacher's columns ride in the batch beside the labels (padded and packed
    alike), logits are made at the answer positions only; plain head and chunked head (speedups/chunked_lm_loss.py)
    give the hand computation's loss and gradients."""
    from effitrain import tasks
    from effitrain.speedups import chunked_lm_loss
    from effitrain.tasks import lm_head
    from effitrain.tasks.lm_distillation import LMDistillation

    alpha, temperature, top_k = 0.4, 1.5, 5
    teacher, student = tiny_llama(48, seed=1), tiny_llama(48, seed=2).train()
    rows = chat_rows(teacher, top_k, temperature)
    task = tasks.get("causal-lm").with_distillation(LMDistillation("unused", alpha, temperature, top_k=top_k))
    if chunked:
        chunked_lm_loss.apply(student)
        assert lm_head.LMHead(student).chunked
    got = []
    for packing in (False, True):
        student.zero_grad()
        loss = task.loss_sum(student, batch_of(rows, top_k, packing))
        loss.backward()
        got.append((float(loss.detach()), {n: p.grad.clone() for n, p in student.named_parameters()}))
    student.zero_grad()
    hand = 0
    for row in rows:  # the prepared head's plain forward still gives the logits (outside hidden_states_of)
        answer = sum(label != -100 for label in row["labels"])
        logits = student(input_ids=torch.tensor([row["input_ids"]])).logits[0, :-1][-answer:]
        hand = hand + hand_loss(logits, torch.tensor(row["labels"][-answer:]), torch.tensor(row[lm_distillation.IDS]),
                                torch.tensor(row[lm_distillation.LOGPS]), alpha, temperature)
    hand.backward()
    for loss, grads in got:
        assert loss == pytest.approx(float(hand), rel=1e-5)
        for name, p in student.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6)


@pytest.fixture(scope="module")
def teacher_dir(tokenizer, tmp_path_factory):
    """A tiny Llama causal LM over the packaged tokenizer's vocabulary, saved with it."""
    path = tmp_path_factory.mktemp("lm-teacher")
    tiny_llama(len(tokenizer), seed=1, hidden=32).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_the_stored_top_k_is_the_teachers_forward_and_a_resume_reads_it_back(teacher_dir, tmp_path, tokenizer,
                                                                             monkeypatch):
    from datasets import Dataset, DatasetDict
    from effitrain import tasks
    from effitrain.config import TrainConfig
    from effitrain.data import text
    from effitrain.tasks.lm_distillation import LMDistillation
    from transformers import AutoModelForCausalLM

    texts = ["free prize now", "see you at noon", "call me", "win cash today!!", "ok", "lunch?", "urgent reply"]
    encoded = text.tokenize(DatasetDict({"train": Dataset.from_dict({"text": texts}),
                                         "validation": Dataset.from_dict({"text": texts[:2]})}), tokenizer, 32,
                            labels=False, end=tokenizer.sep_token_id)
    task = tasks.get("causal-lm").with_distillation(LMDistillation(str(teacher_dir), temperature=2.0, top_k=4))
    student = tiny_llama(len(tokenizer), seed=2)
    task.distillation.check_teacher(task, student, tokenizer)
    _, collate = task.collators(tokenizer, TrainConfig(task="causal-lm"))
    out = task.distillation.prepare(task, student, encoded, tokenizer, collate, 3, tmp_path)
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir).eval()
    with torch.no_grad():
        for row in out["train"]:
            logits = teacher(input_ids=torch.tensor([row["input_ids"]])).logits[0, :-1]  # every token predicts
            logps, ids = torch.log_softmax(logits / 2.0, -1).topk(4, -1)
            assert torch.equal(torch.tensor(row[lm_distillation.IDS]), ids)
            torch.testing.assert_close(torch.tensor(row[lm_distillation.LOGPS]), logps, rtol=1e-5, atol=1e-5)
    assert lm_distillation.IDS not in out["validation"].column_names
    stored = (tmp_path / lm_distillation.FILE).read_bytes()

    def no_teacher(*args, **kwargs):
        raise AssertionError("the teacher was loaded on resume")

    monkeypatch.setattr(LMDistillation, "load_teacher", no_teacher)
    again = task.distillation.prepare(task, student, encoded, tokenizer, collate, 3, tmp_path, resuming=True)
    assert again["train"][lm_distillation.LOGPS] == out["train"][lm_distillation.LOGPS]
    assert (tmp_path / lm_distillation.FILE).read_bytes() == stored
    other = DatasetDict({**encoded, "train": encoded["train"].select([1, 0, 2, 3, 4, 5, 6])})
    with pytest.raises(UserError, match="another teacher folder or other training data"):
        task.distillation.prepare(task, student, other, tokenizer, collate, 3, tmp_path, resuming=True)
    other_k = tasks.get("causal-lm").with_distillation(LMDistillation(str(teacher_dir), temperature=2.0, top_k=3))
    with pytest.raises(UserError, match="another teacher folder or other training data"):
        other_k.distillation.prepare(other_k, student, encoded, tokenizer, collate, 3, tmp_path, resuming=True)


def write_chat(folder):
    """Conversations whose answers differ in length (micro-batches hold different numbers of answer tokens)."""
    path = folder / "chat.jsonl"
    rows = [[{"role": "user", "content": f"message {n} " * (1 + n % 5)},
             {"role": "assistant", "content": " ".join(["ham", "spam"][n % 2] for _ in range(1 + n % 3))}]
            for n in range(40)]
    path.write_text("".join(json.dumps({"messages": row}) + "\n" for row in rows))
    return str(path)


@pytest.fixture(scope="module")
def chat_teacher(tmp_path_factory):
    """A causal LM SFT'd one step on chat data (its model/ holds the tokenizer with ChatML's tokens)."""
    root = tmp_path_factory.mktemp("chat-teacher")
    effitrain.train(dict(model=TEACHER, task="causal-lm", data=write_chat(root), chat_template="chatml",
                         max_train_samples=16, max_eval_samples=4, max_steps=1, batch_size=16, lr=1e-2,
                         output_dir=str(root / "run")))
    return root


def chat_args(chat_teacher, out, *more):
    return ["--model", STUDENT, "--task", "causal-lm", "--data", chat_teacher / "chat.jsonl", "--chat-template",
            "chatml", "--distill-from", chat_teacher / "run" / "model", "--distill-alpha", "0.6",
            "--distill-temperature", "1.5", "--distill-top-k", "7", "--max-train-samples", 16, "--max-eval-samples", 4,
            "--max-new-tokens", 2, "--max-steps", 4, "--precision", "fp32", "--lr", "1e-3", "--no-group-by-length",
            *more, "--output-dir", out]


RESUMABLE = ("--batch-size", 4, "--save-every", 2)


def test_a_resumed_run_reuses_the_stored_top_k_and_ends_as_the_uninterrupted_one(chat_teacher, tmp_path, cli_here,
                                                                                  monkeypatch):
    from effitrain.tasks.lm_distillation import LMDistillation

    straight = cli_here("train", *chat_args(chat_teacher, tmp_path / "straight", *RESUMABLE))
    assert straight.returncode == 0, straight.stderr[-3000:]
    out = tmp_path / "cut"
    first = cli_here("train", *chat_args(chat_teacher, out, *RESUMABLE))
    assert first.returncode == 0, first.stderr[-3000:]
    (out / "metrics.json").unlink()  # as if killed after its step-2 checkpoint
    stored = (out / lm_distillation.FILE).read_bytes()

    def no_teacher(*args, **kwargs):
        raise AssertionError("the teacher was loaded on resume")

    monkeypatch.setattr(LMDistillation, "load_teacher", no_teacher)
    resumed = cli_here("train", *chat_args(chat_teacher, out, *RESUMABLE), "--resume", "auto")
    assert resumed.returncode == 0 and "resumed from" in resumed.stdout, resumed.stderr[-3000:]
    assert (out / lm_distillation.FILE).read_bytes() == stored
    wanted, got = read_weights(tmp_path / "straight"), read_weights(out)
    assert all(torch.equal(wanted[name], got[name]) for name in wanted)

    for damage in ("deleted", "edited"):
        (out / "metrics.json").unlink()
        path = out / lm_distillation.FILE
        if damage == "deleted":
            path.rename(out / "aside")
        else:
            (out / "aside").rename(path)
            data = bytearray(path.read_bytes())
            data[-1] ^= 0x10
            path.write_bytes(bytes(data))
        result = cli_here("train", *chat_args(chat_teacher, out, *RESUMABLE), "--resume", "auto")
        assert result.returncode == 2, result.stderr[-3000:]
        line = result.stderr.strip().splitlines()[-1]
        assert "teacher's stored top-k log-probs" in line
        assert ("is missing" if damage == "deleted" else "digest differs") in line
        (out / "metrics.json").write_text("{}")


def test_two_processes_and_accumulation_equal_one_big_batch(chat_teacher, tmp_path):
    """2 processes x micro-batch 4 x accumulation 2 against 1 x 16, on chat data whose micro-batches hold
    different numbers of answer tokens, with --packing in the first (fp32, 1e-5)."""
    common = chat_args(chat_teacher, None)[:-2]  # without --output-dir
    ddp = torchrun(2, "train", *common, "--batch-size", 4, "--grad-accum", 2, "--packing", "--output-dir",
                   tmp_path / "ddp")
    assert ddp.returncode == 0, [line for line in ddp.stderr.splitlines() if "rror" in line][:5]
    effitrain.cli.main(["train", *map(str, common), "--batch-size", "16", "--output-dir", str(tmp_path / "single")])
    wanted, got = read_weights(tmp_path / "single"), read_weights(tmp_path / "ddp")
    for name in wanted:
        torch.testing.assert_close(got[name], wanted[name], rtol=1e-5, atol=1e-5)
    assert json.loads((tmp_path / "ddp" / "metrics.json").read_text())["world_size"] == 2
