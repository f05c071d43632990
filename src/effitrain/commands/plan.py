"""`effitrain plan`: the peak memory per device of each combination of techniques, predicted on fake
tensors before anything is loaded, and the fastest combination that fits the budget."""

from __future__ import annotations

import argparse
import json

from effitrain import config as cfg
from effitrain import optimizers
from effitrain.errors import UserError

# The flags plan shares with train: same meaning, same default (help and choices from the config's fields).
SHARED_MODEL = ("model", "tokenizer", "task", "student_layers")
SHARED_STRATEGY = ("strategy", "zero_stage")
SHARED_PEFT = ("peft", "lora_r", "lora_dropout", "lora_target_modules")
SHARED_PREFERENCE = ("preference", "reference")
# Online RL's settings that change the step's memory (the rest change only what it computes).
SHARED_RL = ("rl", "num_generations", "max_new_tokens", "kl_beta", "top_p")
# --distill-from: the teacher's pass before training (with --rl distill: the teacher held in the step,
# planning/rl_step.py), in batches of --eval-batch-size (planning/teacher_pass.py).
SHARED_DISTILL = ("distill_from", "eval_batch_size")


def add_parser(commands) -> None:
    plan = commands.add_parser("plan", help="predict peak memory per device for each combination of techniques, "
                                            "and recommend the fastest that fits",
                               description="Predict the peak memory of training, per device, before loading "
                                           "anything: the model is built on fake tensors.")
    cfg.add_flags(plan, SHARED_MODEL, defaults=True)
    plan.add_argument("--seq-len", type=int, default=128, help="tokens per example (audio: samples; --rl: "
                                                               "prompt tokens, the completion's come on top)")
    # Not train's --batch-size (a micro-batch): the planner chooses how to split these examples.
    plan.add_argument("--batch-size", type=int, default=16, help="examples per device per optimizer step; "
                                                                 "split into micro-batches x accumulation "
                                                                 "(--rl: prompts, each sampled "
                                                                 "--num-generations times)")
    plan.add_argument("--memory", default=None, help="the budget per device, e.g. 8GiB (default: what is free "
                                                     "on the device now)")
    plan.add_argument("--world-size", type=int, default=1, help="processes (devices) training together")
    cfg.add_flags(plan, SHARED_STRATEGY, defaults=True)
    plan.add_argument("--device", choices=("cpu", "cuda"), default=None, help="plan for this device "
                                                                              "(default: the one here)")
    # Repeatable subsets of train's choices (auto is a choice made at run time, not a precision to plan).
    plan.add_argument("--precision", action="append",
                      choices=[p for p in cfg.meta("precision")["choices"] if p != "auto"],
                      help="only these precisions (repeatable; default fp32 and bf16)")
    plan.add_argument("--optim", action="append", choices=cfg.meta("optim")["choices"],
                      help=f"only these optimizers (repeatable; default {', '.join(optimizers.everyday())})")
    plan.add_argument("--num-labels", type=int, default=2)
    cfg.add_flags(plan, SHARED_PEFT, defaults=True,
                  default_notes={"peft": " (default: none; planned as train applies them: only the adapters "
                                         "and the head have gradients and optimizer states)"})
    cfg.add_flags(plan, SHARED_PREFERENCE, defaults=True,
                  default_notes={"preference": " (planned as two sequences per pair: --batch-size counts pairs)"})
    cfg.add_flags(plan, SHARED_RL, defaults=True,
                  default_notes={"rl": " (default: none; planned as a step that generates, then updates: its peak "
                                       "is the larger of the two)",
                                 "max_new_tokens": f" (default with --rl: {cfg.RL_MAX_NEW_TOKENS})"})
    cfg.add_flags(plan, SHARED_DISTILL, defaults=True,
                  default_notes={"distill_from": " (planned: the teacher's pass before training, beside the "
                                                 "student; the peak is the larger of it and the training step)"})
    plan.add_argument("--all", action="store_true", help="every micro-batch, not only the largest that fits")
    plan.add_argument("--json", action="store_true", help="print the rows and the recommendation as JSON")
    plan.add_argument("--debug", action="store_true")


def check_flags(args) -> None:
    cfg.check_value("batch_size", args.batch_size)  # train's rule, and its words
    cfg.check_value("student_layers", args.student_layers)
    cfg.check_value("eval_batch_size", args.eval_batch_size)
    for name in ("seq_len", "world_size"):
        cfg.check_value(name, getattr(args, name), {"positive": True})
    cfg.check_value("num_labels", args.num_labels, {"positive": True, "at_most": 1_000_000})  # a head per label
    for name in args.optim or []:  # what `train` would refuse with these settings
        problem = cfg.optimizer_refusal(name, args.strategy, args.peft)
        if problem is not None:
            raise problem
    cfg.check_tokenizer(args.tokenizer)
    cfg.validate(_peft_config(args))  # --peft, --lora-* and --preference by train's rules (before torch loads)
    cfg.validate(_reference_config(args))
    _check_rl(args)
    if args.memory is not None and cfg.parse_size(args.memory) <= 0:
        raise UserError(f"--memory must be > 0, got {args.memory}", "pass e.g. 8GiB, or leave it out to plan "
                        "for what is free on the device now")


def _vocabulary(args) -> int | None:
    """--tokenizer's vocabulary (a model built from a config takes it), or None: the config's own."""
    if args.tokenizer is None:
        return None
    from effitrain.models import loading

    source = loading.resolve_source(args.model, allow_pickle=True, tokenizer=args.tokenizer)
    return len(loading.load_text_tokenizer(source))


def main(args) -> int:
    import torch

    from effitrain.planning import planner as plan
    from effitrain.runtime import devices, libraries

    libraries.quiet_libraries(args.debug)
    device = args.device or ("cuda" if devices.has_accelerator() else "cpu")
    if args.memory is None and device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda on a machine without a CUDA GPU: there is no free memory to read",
                        "pass the GPU's memory, e.g. --memory 80GiB")
    budget = cfg.parse_size(args.memory) if args.memory else plan.available_bytes(device)
    # The config as written (its own vocabulary), or --tokenizer's: what a text model built from a config gets
    # in `train` (whose --memory-budget plans with the tokenizer it loaded).
    shapes = plan.model_shapes(args.task, args.model, args.num_labels, _vocabulary(args), peft=_plan_peft(args),
                               student_layers=args.student_layers)
    shapes = plan.for_preference(shapes, args.preference, _plan_reference(args))
    planner, estimate_of = _planner(args, shapes, device)
    teacher = _teacher(args)
    if teacher is not None:
        from effitrain.planning import teacher_pass

        estimate_of = teacher_pass.estimator(planner, teacher, args.eval_batch_size, estimate_of)
    rows = plan.best_per_technique(planner, args.batch_size, args.precision or ["fp32", "bf16"], _optimizers(args),
                                   [False, True] if shapes.supports_checkpointing else [False],
                                   budget, args.all, estimate_of)
    best = plan.recommend(rows)
    if args.json:
        print(json.dumps({"model": args.model, "task": args.task, "peft": args.peft,
                          "student_layers": args.student_layers, "distill_from": args.distill_from,
                          "teacher_parameters": teacher.parameters if teacher else None,
                          "eval_batch_size": args.eval_batch_size, "parameters": shapes.parameters,
                          "trainable": shapes.trainable, "buffer_bytes": shapes.buffer_bytes,
                          "seq_len": args.seq_len, "batch_size": args.batch_size, **_rl_settings(args),
                          "world_size": args.world_size, "strategy": args.strategy, "device": device,
                          "budget": budget, "rows": [r.to_dict() for r in rows],
                          "recommended": best.to_dict() if best else None}))
        return 0
    per_step = (f"{args.batch_size} prompts of {args.seq_len} tokens x {args.num_generations} completions of up to "
                f"{_max_new_tokens(args)} tokens (--rl {args.rl}: the step generates, then updates)"
                if args.rl else f"{args.batch_size} x {args.seq_len}")
    student = f", a student of {args.student_layers} layers" if args.student_layers else ""
    print(f"{args.model} ({args.task}{student}): {shapes.parameters:,} parameters, {shapes.trainable:,} trainable; "
          f"{per_step} per {device} device per step, {args.world_size} process(es) "
          f"({args.strategy}); budget {budget / plan.GiB:.2f} GiB per device. GiB per device:")
    if teacher is not None:
        print(f"distilled from {args.distill_from} ({teacher.parameters:,} parameters): its pass over the training "
              f"data before the first step, {args.eval_batch_size} x {args.seq_len} a batch (--eval-batch-size), "
              "beside the student; each row's total is the larger of it and the training step ('peak in')")
    print(plan.format_table(rows, best))
    if best is None:
        print("nothing fits: raise --memory, shorten --seq-len, add processes with --strategy fsdp, "
              "or use a smaller model")
    else:
        s = best.setting
        print(f"recommended: --precision {s.precision} --optim {s.optimizer} --batch-size {s.micro_batch} "
              f"--grad-accum {s.accumulation}" + (" --gradient-checkpointing" if s.checkpointing else "")
              + f" ({best.total / plan.GiB:.2f} GiB, {best.relative_speed:.2f}x the speed of fp32 AdamW)")
    return 0


def _planner(args: argparse.Namespace, shapes, device: str):
    """The planner and what it asks per setting: a training step of --seq-len tokens, or with --rl a step that
    generates --num-generations completions of each prompt and then updates on them (planning/rl_step.py)."""
    from effitrain.planning import planner as plan
    from effitrain.planning import rl_step

    if args.rl is None:
        return plan.Planner(shapes, args.seq_len, device, args.world_size, args.strategy, args.zero_stage), None
    new_tokens = _max_new_tokens(args)
    teacher = None if args.distill_from is None else rl_step.teacher_bytes(args.task, args.distill_from)
    shapes = rl_step.for_rl(shapes, args.num_generations, new_tokens, args.kl_beta, args.rl, teacher=teacher)
    planner = plan.Planner(shapes, args.seq_len + new_tokens, device, args.world_size, args.strategy,
                           args.zero_stage)
    return planner, rl_step.estimator(planner, args.seq_len, new_tokens, args.top_p)


def _teacher(args: argparse.Namespace):
    """--distill-from's model shapes (its config alone, on fake tensors), checked as train checks the folder; None
    with --rl (on-policy: the teacher is held during the step and planned there, not run before training)."""
    if args.distill_from is None or args.rl is not None:
        return None
    from effitrain.planning import planner as plan

    cfg.validate(cfg.TrainConfig(task=args.task, distill_from=args.distill_from))
    return plan.model_shapes(args.task, args.distill_from, args.num_labels)


def _max_new_tokens(args: argparse.Namespace) -> int:
    return args.max_new_tokens or cfg.RL_MAX_NEW_TOKENS  # train's default with --rl (config.resolved)


def _rl_settings(args: argparse.Namespace) -> dict:
    if args.rl is None:
        return {}
    return {"rl": args.rl, "num_generations": args.num_generations, "max_new_tokens": _max_new_tokens(args),
            "kl_beta": args.kl_beta, "top_p": args.top_p}


def _check_rl(args: argparse.Namespace) -> None:
    """--rl and its flags by train's rules (--rl with --preference, --num-generations 1, ...), and --rl only on a
    task that generates; --max-new-tokens, which train also takes for evaluation, plans nothing without --rl."""
    from effitrain import tasks

    config = cfg.TrainConfig(task=args.task, peft=args.peft, preference=args.preference, rl=args.rl,
                             num_generations=args.num_generations, max_new_tokens=args.max_new_tokens,
                             kl_beta=args.kl_beta, top_p=args.top_p, distill_from=args.distill_from)
    cfg.validate(config)
    if args.rl is None:
        if args.max_new_tokens is not None:
            raise UserError("--max-new-tokens plans the completions of online RL, and --rl is not set",
                            f"pass --rl {cfg.RL[0]}, or drop --max-new-tokens")
        return
    task = tasks.get(args.task)
    if not task.supports_rl:
        task.check_config(cfg.resolved(config))  # refuses --rl with the task's name, as train does


def _optimizers(args: argparse.Namespace) -> list[str]:
    """The optimizers to plan: those asked for (`check_flags` refused those `train` would), else the everyday ones
    (their specs' `plan_rank`) that `train` accepts with these settings."""
    return cfg.accepted_optimizers(args.optim or optimizers.everyday(), args.strategy, args.peft)


def _plan_peft(args: argparse.Namespace):
    """`plan --peft` and the --lora-* flags, checked as `train` checks them."""
    from effitrain.planning import planner as plan

    return plan.Peft.of(_peft_config(args))


def _peft_config(args: argparse.Namespace) -> cfg.TrainConfig:
    return cfg.TrainConfig(peft=args.peft, lora_r=args.lora_r, lora_dropout=args.lora_dropout,
                           lora_target_modules=args.lora_target_modules, strategy=args.strategy,
                           zero_stage=args.zero_stage)


def _reference_config(args: argparse.Namespace) -> cfg.TrainConfig:
    return cfg.TrainConfig(task=args.task, peft=args.peft, preference=args.preference, reference=args.reference)


def _plan_reference(args: argparse.Namespace) -> str | None:
    """`plan --preference/--reference`, checked and defaulted as `train` does them (the reference it holds)."""
    from effitrain import tasks

    config = cfg.resolved(_reference_config(args))
    if config.preference is not None:
        tasks.for_config(config)  # --preference on a task that has no such form: refused with its name
    return config.reference
