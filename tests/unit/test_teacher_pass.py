"""--distill-from's teacher pass in the plan (planning/teacher_pass.py): before the first step the teacher runs
once in evaluation mode without gradients beside the student, so the run's peak is the larger of that pass and
the student's training step."""

import json

import pytest
from effitrain.planning import planner as plan
from effitrain.planning import simulate, teacher_pass

TASK = "sequence-classification"


def bert_folder(folder, layers: int, hidden: int):
    """A saved config and a stand-in weights file (the planner reads the config alone)."""
    import torch
    from safetensors.torch import save_file
    from transformers import BertConfig

    folder.mkdir()
    BertConfig(vocab_size=1000, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
               intermediate_size=4 * hidden, id2label={0: "ham", 1: "spam"},
               label2id={"ham": 0, "spam": 1}).save_pretrained(folder)
    save_file({"unused": torch.zeros(1)}, str(folder / "model.safetensors"))
    return str(folder)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("planned")
    return {"student": bert_folder(root / "student", 2, 32), "small": bert_folder(root / "small", 2, 32),
            "big": bert_folder(root / "big", 4, 512), "deep": bert_folder(root / "deep", 8, 512)}


def test_a_no_grad_forward_frees_each_layers_activations():
    """The pass's forward peak does not grow with depth (each layer's activations go once the next has read them),
    where a training forward holds every layer's for the backward."""
    from transformers import BertConfig

    config = BertConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=256)
    shallow = simulate.inference_peak(TASK, config, 8, 64, "fp32")
    deep = simulate.inference_peak(TASK, simulate.with_depth(config, 8), 8, 64, "fp32")
    # At least the largest tensor a layer makes: the attention scores, 8 x 4 heads x 64 x 64 fp32.
    assert shallow >= 8 * 4 * 64 * 64 * 4
    trained = [simulate.micro_step(TASK, simulate.with_depth(config, d), 8, 64, "fp32", False).forward_held
               for d in (2, 8)]
    # Per layer: a training forward keeps ~4 MiB here for its backward; the pass keeps a few small tensors the
    # fake-tensor simulation does not see freed (under 5% of that: counted, so the plan errs high).
    assert 0 <= (deep - shallow) / 6 < 0.05 * (trained[1] - trained[0]) / 6


def test_the_plans_peak_is_the_larger_of_the_teacher_pass_and_the_step(models):
    student = plan.model_shapes(TASK, models["student"])
    planner = plan.Planner(student, 64, "cpu")
    setting = plan.Setting("fp32", "adamw", False, 4, 1)
    update = planner.estimate(setting)
    for name, eval_batch, phase in (("small", 4, "update"), ("big", 128, "teacher pass")):
        teacher = plan.model_shapes(TASK, models[name])
        held = teacher_pass.pass_bytes(planner, teacher, eval_batch, "fp32")
        # By hand: the student's weights, the teacher's (fp32) and the teacher forward's peak at the eval batch.
        assert held == (4 * student.parameters + student.buffer_bytes + 4 * teacher.parameters + teacher.buffer_bytes
                        + simulate.inference_peak(TASK, teacher.config, eval_batch, 64, "fp32"))
        row = teacher_pass.estimate(planner, teacher, eval_batch, setting)
        assert row.peak_phase == phase
        assert row.total == max(update.total, held + update.overhead)
        assert (row.weights, row.gradients, row.optimizer, row.overhead) == \
            (update.weights, update.gradients, update.optimizer, update.overhead)
    # The eval batch is what the pass's peak grows with.
    teacher = plan.model_shapes(TASK, models["big"])
    assert teacher_pass.pass_bytes(planner, teacher, 256, "fp32") > teacher_pass.pass_bytes(planner, teacher, 128,
                                                                                           "fp32")


def test_plan_distill_from_prints_the_teacher_pass(models, capsys):
    from effitrain.cli import main

    flags = ["plan", "--model", models["student"], "--seq-len", "64", "--batch-size", "4", "--memory", "8GiB",
             "--optim", "adamw", "--precision", "fp32"]
    assert main([*flags, "--distill-from", models["big"]]) == 0
    printed = capsys.readouterr().out
    assert f"distilled from {models['big']} (" in printed and "128 x 64 a batch (--eval-batch-size)" in printed
    assert "peak in" in printed and "teacher pass" in printed
    assert main([*flags, "--distill-from", models["big"], "--eval-batch-size", "2", "--json"]) == 0
    small_batch = json.loads(capsys.readouterr().out)
    assert small_batch["distill_from"] == models["big"] and small_batch["eval_batch_size"] == 2
    assert main([*flags, "--json"]) == 0
    alone = json.loads(capsys.readouterr().out)
    assert all(r["total"] <= d["total"] for r, d in zip(alone["rows"], small_batch["rows"]))
    assert main([*flags, "--distill-from", models["big"] + "-missing"]) == 2
    assert "--distill-from" in capsys.readouterr().err


def fitted(student: str, teacher: str | None, budget: int, fixed=None, **settings):
    """`train --memory-budget`'s plan (engine/memory_fit.plan_run) on a CPU, one process: (pieces, note, numbers)."""
    import torch
    from effitrain.config import TrainConfig
    from effitrain.engine import memory_fit

    config = TrainConfig(model=student, distill_from=teacher, memory_budget=str(budget), batch_size=8,
                         max_length=64, eval_batch_size=settings.pop("eval_batch_size", 128), optim="adamw",
                         **settings)
    vocabulary = [None] * 1000  # a stand-in tokenizer: the plan reads its length only
    pieces, _, _, note, numbers = memory_fit.plan_run(config, torch.device("cpu"), 1, 1, "no", 2, vocabulary,
                                                      fixed=fixed)
    return pieces, note, numbers


def test_train_memory_budget_plans_the_teacher_pass(models):
    """With --distill-from the fitted plan's peak is the larger of the teacher pass and the step: a big teacher
    makes the pass the peak; a budget the pass does not fit is refused before the run, naming it; a budget the
    step does not fit whole splits the micro-batch as without a teacher."""
    from effitrain.errors import UserError

    student = plan.model_shapes(TASK, models["student"], 2, 1000)
    planner = plan.Planner(student, 64, "cpu")
    update = planner.estimate(plan.Setting("fp32", "adamw", False, 8, 1))
    teacher = plan.model_shapes(TASK, models["big"], 2)
    held = teacher_pass.pass_bytes(planner, teacher, 128, "fp32") + update.overhead
    assert held > 2 * update.total  # the big teacher's pass is the peak
    roomy = 64 * plan.GiB
    alone = fitted(models["student"], None, roomy)
    assert alone[0] == 1 and alone[2]["predicted_peak_bytes"] == update.total
    pieces, note, numbers = fitted(models["student"], models["big"], roomy)
    assert pieces == 1 and numbers["predicted_peak_bytes"] == held
    assert "(in the teacher's pass before training) with micro-batch 8" in note
    # Between the step and the pass: the step alone fits whole, the run with the teacher is refused in one line.
    between = (update.total + held) // 2
    assert fitted(models["student"], None, between)[0] == 1
    with pytest.raises(UserError) as refused:
        fitted(models["student"], models["big"], between)
    assert refused.value.problem.startswith(f"--distill-from {models['big']}: the teacher's pass before training")
    assert "--eval-batch-size 128" in refused.value.problem and "lower --eval-batch-size" in refused.value.fix
    assert "\n" not in str(refused.value)
    # A smaller pass (batches of 2) fits there: the step is the peak again.
    pieces, note, numbers = fitted(models["student"], models["big"], between, eval_batch_size=2)
    small_pass = teacher_pass.pass_bytes(planner, teacher, 2, "fp32") + update.overhead
    assert numbers["predicted_peak_bytes"] == max(update.total, small_pass) and pieces == 1
    # A budget the step at 8 examples does not fit: split in pieces as without a teacher (the small teacher's pass,
    # in batches of 2, fits beside it).
    half = planner.estimate(plan.Setting("fp32", "adamw", False, 4, 2))
    tight = (half.total + update.total) // 2
    small = teacher_pass.pass_bytes(planner, plan.model_shapes(TASK, models["small"], 2), 2, "fp32")
    assert small + half.overhead < tight
    assert fitted(models["student"], None, tight)[0] == 2
    pieces, _, numbers = fitted(models["student"], models["small"], tight, eval_batch_size=2)
    assert pieces == 2 and numbers["predicted_peak_bytes"] == half.total
    # A resumed run reads its stored logits back (no teacher pass): planned as the step alone.
    resumed = fitted(models["student"], models["big"], between, fixed=("adamw", False))
    assert resumed[0] == 1 and resumed[2]["predicted_peak_bytes"] == update.total
