"""On-policy distillation's loss (--rl distill, tasks/objectives/on_policy_distill.py): the divergence and its
gradient against hand computations in float64 (beta 0: forward KL, 1: reverse KL, between: the generalised JSD),
against TRL 1.16 GKD's generalized_jsd_loss (skipped without /tmp/trl116), and the objective's loss on a tiny
Llama micro-batch against the two models' whole-sequence logits; the teacher is never trained."""

import math
import sys
import warnings
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import effitrain.tasks.objectives.completion_batches as completion_batches
from effitrain.tasks.objectives.on_policy_distill import OnPolicyDistill, divergence

TRL = Path("/tmp/trl116")


def hand_divergence(student: torch.Tensor, teacher: torch.Tensor, beta: float, temperature: float) -> torch.Tensor:
    """The definition written out with probabilities, row by row (float64)."""
    out = torch.zeros(student.shape[:-1], dtype=torch.float64)
    for index in torch.cartesian_prod(*[torch.arange(n) for n in student.shape[:-1]]).view(-1, student.dim() - 1):
        at = tuple(index.tolist())
        s = torch.softmax(student[at] / temperature, -1)
        t = torch.softmax(teacher[at] / temperature, -1)
        if beta == 0:
            value = (t * (t.log() - s.log())).sum()
        elif beta == 1:
            value = (s * (s.log() - t.log())).sum()
        else:
            m = beta * t + (1 - beta) * s
            value = beta * (t * (t.log() - m.log())).sum() + (1 - beta) * (s * (s.log() - m.log())).sum()
        out[at] = value
    return out


@pytest.mark.parametrize("beta", [0.0, 0.25, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 2.0])
def test_the_divergence_and_its_gradient_equal_the_hand_computation(beta, temperature):
    generator = torch.Generator().manual_seed(7)
    student = torch.randn(2, 3, 11, generator=generator, dtype=torch.float64, requires_grad=True)
    teacher = torch.randn(2, 3, 11, generator=generator, dtype=torch.float64) * 2
    weights = torch.rand(2, 3, generator=generator, dtype=torch.float64)
    got = divergence(student.double(), teacher, beta, temperature).double()
    # divergence computes in fp32 (the logits' float()); the hand one in float64
    wanted = hand_divergence(student.detach(), teacher, beta, temperature)
    torch.testing.assert_close(got, wanted, rtol=1e-5, atol=1e-6)
    (grad,) = torch.autograd.grad((got * weights).sum(), student)
    s = torch.softmax(student.detach() / temperature, -1)
    t = torch.softmax(teacher / temperature, -1)
    if beta == 0:  # d KL(t || s) / dz = (s - t) / T
        wanted_grad = (s - t) / temperature
    elif beta == 1:  # d KL(s || t) / dz = s (log s - log t - KL(s || t)) / T
        kl = (s * (s.log() - t.log())).sum(-1, keepdim=True)
        wanted_grad = s * (s.log() - t.log() - kl) / temperature
    else:  # the hand formula's own gradient
        leaf = student.detach().clone().requires_grad_(True)
        sh = torch.softmax(leaf / temperature, -1)
        m = beta * t + (1 - beta) * sh
        hand = beta * (t * (t.log() - m.log())).sum(-1) + (1 - beta) * (sh * (sh.log() - m.log())).sum(-1)
        (wanted_grad,) = torch.autograd.grad(hand, leaf, grad_outputs=torch.ones_like(hand))
    torch.testing.assert_close(grad, wanted_grad * weights[..., None], rtol=1e-4, atol=1e-6)


def test_beta_1_is_the_reverse_kl_and_0_the_forward_kl_as_trl_names_them():
    student, teacher = torch.tensor([[2.0, 0.0, -1.0]]), torch.tensor([[0.0, 1.0, 0.0]])
    s, t = torch.softmax(student, -1), torch.softmax(teacher, -1)
    assert divergence(student, teacher, 1.0).item() == pytest.approx(float((s * (s / t).log()).sum()), rel=1e-6)
    assert divergence(student, teacher, 0.0).item() == pytest.approx(float((t * (t / s).log()).sum()), rel=1e-6)


@pytest.mark.skipif(not (TRL / "trl").is_dir(), reason="TRL 1.16 is not installed in /tmp/trl116")
@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 0.9])
def test_equals_trl_gkd_generalized_jsd_loss(beta, temperature):
    sys.path.insert(0, str(TRL))
    # TRL's warnings (its experimental-API one) are of classes from trl: a pytest-xdist controller, which cannot
    # import trl, fails to unpickle them and stops the whole suite. None is wanted here.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            from trl.experimental.gkd.gkd_trainer import GKDTrainer
        except Exception as err:  # TRL's import needs what this environment may lack
            pytest.skip(f"TRL's GKD trainer does not import: {err}")
        finally:
            sys.path.remove(str(TRL))
    generator = torch.Generator().manual_seed(3)
    student, teacher = torch.randn(3, 5, 17, generator=generator), torch.randn(3, 5, 17, generator=generator)
    labels = torch.randint(0, 17, (3, 5), generator=generator)
    labels[0, 3:] = -100
    labels[2, 1] = -100
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = GKDTrainer.generalized_jsd_loss(student, teacher, labels=labels, beta=beta, temperature=temperature)
    mask = (labels != -100).float()
    ours = (divergence(student, teacher, beta, temperature) * mask).sum() / mask.sum()
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7)


def tiny_llama(seed: int, layers: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=23, hidden_size=16, num_hidden_layers=layers, num_attention_heads=2,
                         num_key_value_heads=2, intermediate_size=32, max_position_embeddings=32)
    return LlamaForCausalLM(config).double().eval()


def micro_batch(generations: int = 2) -> dict:
    """Two prompts (the second left-padded), each with `generations` completions, one of them with padding."""
    prompts = torch.tensor([[5, 6, 7], [0, 8, 9]]).repeat_interleave(generations, 0)
    prompt_mask = torch.tensor([[1, 1, 1], [0, 1, 1]]).repeat_interleave(generations, 0)
    completions = torch.tensor([[1, 2, 3, 4], [2, 2, 0, 0], [3, 1, 4, 0], [4, 4, 4, 4]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]])
    batch = completion_batches.sequences(prompts, prompt_mask, completions, mask)
    rows = len(mask)
    batch.update(completion_mask=mask, completion_sums=torch.zeros(rows, 3, dtype=torch.float64),
                 token_weight=torch.full((rows,), rows / float(mask.sum()), dtype=torch.float64))
    return batch


def whole_sequence_logits(model, batch) -> torch.Tensor:
    """The logits predicting each completion token, from one plain forward over the whole rows."""
    width = batch["completion_mask"].shape[1]
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   position_ids=batch["position_ids"]).logits
    return logits[:, -width - 1:-1].double()


@pytest.mark.parametrize("beta, temperature", [(1.0, 1.0), (0.0, 2.0), (0.5, 0.8)])
def test_the_objective_loss_and_gradient_equal_the_divergence_of_the_two_models(beta, temperature):
    student, teacher = tiny_llama(0, 2), tiny_llama(1, 3)
    student.train()
    before = {name: p.detach().clone() for name, p in teacher.named_parameters()}
    objective = OnPolicyDistill(generations=2, max_new_tokens=4, divergence_beta=beta,
                                distill_temperature=temperature)
    objective.teacher_model = teacher.requires_grad_(False)
    batch = micro_batch()
    found = objective.loss(student, batch)
    mask = batch["completion_mask"].double()
    with torch.no_grad():
        teacher_logits = whole_sequence_logits(teacher, batch)
    student_logits = whole_sequence_logits(student, batch)
    wanted = (hand_divergence(student_logits.detach(), teacher_logits, beta, temperature) * mask).sum()
    # The divergence is computed in fp32 (as in training): its sum over the vocabulary cancels, so the AVX2 and
    # AVX-512 kernels differ from float64 by up to ~2e-5 of a small loss; 1e-6 absolute bounds that.
    assert found.loss_sum.item() == pytest.approx(wanted.item(), rel=1e-5, abs=1e-6)
    assert objective.item_count(batch).item() == mask.sum().item()  # the step's tokens normalise
    # the log's kl: the token sum x completions / tokens, summed over completions / completions = per token
    assert found.sums[0].item() / found.sums[-1].item() == pytest.approx(wanted.item() / mask.sum().item(), rel=1e-5,
                                                                         abs=1e-7)
    grads = torch.autograd.grad(found.loss_sum, list(student.parameters()))
    plain = (divergence(student_logits, teacher_logits, beta, temperature) * mask).sum()
    wanted_grads = torch.autograd.grad(plain, list(student.parameters()))
    for got, expected in zip(grads, wanted_grads):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-7)
    assert all(p.grad is None and not p.requires_grad for p in teacher.parameters())
    assert all(torch.equal(before[name], p) for name, p in teacher.named_parameters())


def test_rows_without_a_counted_token_add_nothing():
    """--mask-truncated leaves a completion out: its row is dropped from the forward, the loss unchanged."""
    student, teacher = tiny_llama(0, 2), tiny_llama(1, 2)
    objective = OnPolicyDistill(generations=2, max_new_tokens=4)
    objective.teacher_model = teacher.requires_grad_(False)
    batch = micro_batch()
    whole = objective.loss(student, batch).loss_sum
    masked = dict(batch, completion_mask=batch["completion_mask"].clone())
    masked["completion_mask"][1] = 0
    kept = objective.loss(student, masked).loss_sum
    mask = batch["completion_mask"].double()
    with torch.no_grad():
        per_token = divergence(whole_sequence_logits(student, batch), whole_sequence_logits(teacher, batch), 1.0)
    assert whole.item() == pytest.approx(float((per_token * mask).sum()), rel=1e-5)
    assert kept.item() == pytest.approx(float((per_token * mask).sum() - (per_token[1] * mask[1]).sum()), rel=1e-5)
    assert math.isfinite(kept.item())
