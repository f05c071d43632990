"""The peak of --distill-from's teacher pass (tasks/distillation.py): before the first step, the teacher runs
once over the training split, in evaluation mode without gradients, in batches of --eval-batch-size, beside the
student already loaded; then it is freed. A big teacher's pass can peak above the student's training, so the
run's peak is the larger of the two:

    teacher pass = student weights + teacher weights (fp32, whole on every process: each runs its share of the
                   rows) + the teacher forward's peak (planning/simulate.inference_peak) + the allocator's overhead
    update       = the student's training step (planner.Planner.estimate)

No gradient and no optimizer state exists yet during the pass (the optimizer's states are made at its first
step)."""

from __future__ import annotations

from dataclasses import replace

from effitrain.planning import simulate
from effitrain.planning.planner import Estimate, Estimator, ModelShapes, Planner, Setting

PHASES = ("teacher pass", "update")  # Estimate.peak_phase


def pass_bytes(planner: Planner, teacher: ModelShapes, eval_batch: int, precision: str) -> int:
    """The pass's peak on one device, the allocator's overhead left out: what it holds beyond it."""
    student_weights = planner.model_states("adamw")[0]
    forward = simulate.inference_peak(teacher.task, teacher.config, eval_batch, planner.seq_len, precision)
    return student_weights + teacher.weight_bytes + teacher.buffer_bytes + forward


def estimate(planner: Planner, teacher: ModelShapes, eval_batch: int, setting: Setting) -> Estimate:
    """The setting's row: the larger of the update and the teacher pass (`combined`)."""
    return combined(setting, planner.estimate(setting), pass_bytes(planner, teacher, eval_batch, setting.precision))


def combined(setting: Setting, update: Estimate, teacher_pass: int) -> Estimate:
    """The update's row, its activations raised to what the teacher pass (`teacher_pass`: pass_bytes) holds
    beyond the row's weights, gradients, states and overhead where the pass peaks higher; `peak_phase` says which."""
    teacher_total = teacher_pass + update.overhead
    held = update.weights + update.gradients + update.optimizer + update.overhead
    phase = PHASES[0] if teacher_total > update.total else PHASES[1]
    return replace(update, activations=max(update.activations, teacher_total - held), peak_phase=phase)


def estimator(planner: Planner, teacher: ModelShapes, eval_batch: int, base: Estimator | None = None) -> Estimator:
    """What `plan` and `train --memory-budget` ask per setting (planner.best_per_technique, planner.fit); the
    pass simulated once per precision (it depends on nothing else of the setting)."""
    passes: dict[str, int] = {}

    def estimate_of(setting: Setting) -> Estimate:
        if setting.precision not in passes:
            passes[setting.precision] = pass_bytes(planner, teacher, eval_batch, setting.precision)
        return combined(setting, (base or planner.estimate)(setting), passes[setting.precision])

    return estimate_of
