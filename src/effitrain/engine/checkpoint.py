"""Checkpoints that a crash cannot damage, and resuming from them at the exact data position.

A checkpoint is accelerate's save_state (model, optimizer, scheduler, gradient scaler, every RNG
state) plus trainer_state.json (step, loop counters, the settings that must match to resume). It is
written to checkpoints/.tmp-step-N, flushed, then renamed to checkpoints/step-N: a rename is atomic,
so a kill during a save leaves the previous checkpoint and a .tmp folder that is ignored and cleared."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from effitrain.config import fields, meta
from effitrain.errors import UserError
from effitrain.outputs import files as outputs_files

# Settings that decide the arithmetic, the data order and the schedule (the learning rate of each step
# depends on the number of steps): resuming with others would not continue the run. Each field of
# TrainConfig says whether it is one (`resume="must_match"`, config.py). The micro-batch, accumulation and
# processes may change as long as their product does (see `check`).
# Compared in the fields' order, the first difference named, but those marked `resume_first` first (peft:
# its default lr follows from it, and a LoRA checkpoint resumed without --peft must be told so, not that its
# lr differs).
MUST_MATCH = tuple(sorted((f.name for f in fields() if f.metadata["resume"] == "must_match"),
                          key=lambda name: not meta(name).get("resume_first")))
# Free settings that decide the arithmetic once another is set (`must_match_with`: --max-new-tokens, only
# evaluation's for SFT, is the length of every completion GRPO trains on).
MUST_MATCH_WITH = {f.name: f.metadata["must_match_with"] for f in fields() if "must_match_with" in f.metadata}


def must_match(values: dict) -> tuple[str, ...]:
    """The settings a resume of a run with these settings must keep."""
    return MUST_MATCH + tuple(name for name, other in MUST_MATCH_WITH.items() if values.get(other) is not None)


# Settings added after checkpoints were first written (`added_later`): a checkpoint without them was made
# with their defaults.
EARLIER_DEFAULTS = {f.name: f.default for f in fields() if f.metadata.get("added_later")}


PATH_SETTINGS = ("model", "data", "validation_file", "test_file")


def same_setting(key: str, earlier, now) -> bool:
    """Equal, or the same file or folder written another way (./data.csv and /home/me/data.csv)."""
    if earlier == now:
        return True
    if key in PATH_SETTINGS and isinstance(earlier, str) and isinstance(now, str):
        try:
            return Path(earlier).exists() and Path(now).exists() and Path(earlier).samefile(now)
        except OSError:
            return False
    return False


def folder(out_dir: Path) -> Path:
    return Path(out_dir) / "checkpoints"


def complete(out_dir: Path) -> list[Path]:
    """Finished checkpoints, oldest first."""
    found = [p for p in folder(out_dir).glob("step-*") if re.fullmatch(r"step-\d+", p.name)
             and (p / "trainer_state.json").is_file()]
    return sorted(found, key=lambda p: int(p.name.split("-")[1]))


def _fsync_tree(path: Path) -> None:
    for root, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                os.fsync(f.fileno())


def save(strategy, out_dir: Path, step: int, state: dict, keep_last: int | None, trained: tuple) -> Path:
    """`state`: the trainer state (trainer_state.json); `trained`: the (model, optimizer) the strategy
    saves with the rest of the training state."""
    accelerator, base = strategy.accelerator, folder(out_dir)
    tmp, final = base / f".tmp-step-{step}", base / f"step-{step}"
    if accelerator.is_main_process:
        base.mkdir(parents=True, exist_ok=True)
        for stale in base.glob(".tmp-step-*"):  # left by a run killed while saving
            shutil.rmtree(stale, ignore_errors=True)
    accelerator.wait_for_everyone()
    try:
        with outputs_files.writing(tmp):
            strategy.save_checkpoint(tmp, *trained)
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            (tmp / "trainer_state.json").write_text(outputs_files.json_text({**state, "step": step}, indent=1))
            _fsync_tree(tmp)
            if final.exists():
                shutil.rmtree(final)
            os.rename(tmp, final)
    except BaseException:  # a signal or a full disk mid-save: no half checkpoint is left behind
        # Every process, not the main one only: another may still be writing its RNG state into tmp
        # (recreating it) when the main one's signal comes; the last to stop removes what is left.
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if accelerator.is_main_process:
        for old in complete(out_dir)[:-keep_last] if keep_last else []:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def find(out_dir: Path, resume: str) -> Path | None:
    """`auto`: the latest complete checkpoint in the output dir, or None for a fresh start; else a path."""
    if resume == "auto":
        found = complete(out_dir)
        return found[-1] if found else None
    path = Path(resume)
    if not (path / "trainer_state.json").is_file():
        raise UserError(f"--resume {resume} is not a complete effitrain checkpoint (no trainer_state.json)",
                        f"pass --resume auto, or a folder like {folder(out_dir) / 'step-100'}")
    return path


def trainer_state(path: Path) -> dict:
    """The checkpoint's trainer_state.json: step, loop counters, the resolved configuration."""
    return json.loads((path / "trainer_state.json").read_text())


class Checkpointer:
    """When to save (every `every` steps, not at the last one: model/ is written then) and where."""

    def __init__(self, strategy, out_dir: Path, every: int | None, keep_last: int | None, total_steps: int,
                 trained: tuple):
        self.strategy, self.out_dir, self.every = strategy, out_dir, every
        self.keep_last, self.total_steps, self.trained = keep_last, total_steps, trained

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0 and step < self.total_steps

    def save(self, step: int, trainer_state: dict) -> Path:
        return save(self.strategy, self.out_dir, step, trainer_state, self.keep_last, self.trained)

    def restore(self, path: Path, state, world: int, trainer_state: dict) -> None:
        """Weights, optimizer, scheduler, scaler and RNG from `path`; counters into `state`; the log
        cut back to the checkpoint's step (what a killed run logged after it runs again). Files that do not
        fit the model and optimizer their trainer state records (swapped, edited) are refused in one line."""
        import pickle

        from safetensors import SafetensorError

        try:
            self.strategy.load_checkpoint(path, *self.trained)
        except (ValueError, KeyError, IndexError, RuntimeError, pickle.UnpicklingError, SafetensorError) as err:
            made_with = trainer_state.get("config", {})
            said = " ".join(f"{type(err).__name__}: {err}".split())[:300]
            raise UserError(f"checkpoint {path} does not fit the model and --optim {made_with.get('optim')} its "
                            f"trainer_state.json records ({said})", "resume from another checkpoint (--resume "
                            "PATH), or start a new --output-dir") from err
        state.load_state_dict(trainer_state, world)
        if self.strategy.accelerator.is_main_process:
            trim_log(self.out_dir / "log.jsonl", state.step)


def check(path: Path, config_values: dict, world_size: int, grad_accum: int) -> dict:
    """The checkpoint's trainer state, if this run may continue it (checked before anything is written).
    The processes, micro-batch and accumulation may change if the examples of a step stay as many: the
    order of the data depends on the seed, the epoch and that number only, so every later step trains
    on the same examples (to rounding: sums are taken in another order)."""
    state = trainer_state(path)
    made_with = {**EARLIER_DEFAULTS, **state["config"]}
    for key in must_match(made_with):
        if key in made_with and not same_setting(key, made_with[key], config_values.get(key)):
            fix = meta(key).get("resume_fix", "resume with the same settings, or start a new --output-dir")
            raise UserError(f"checkpoint {path} was made with {key}={made_with[key]!r}, this run has "
                            f"{config_values.get(key)!r}", fix.format(made=made_with[key]))
    earlier = made_with["batch_size"] * state.get("plan", {}).get("grad_accum", made_with.get("grad_accum", 1)) \
        * state["world_size"]
    now = config_values["batch_size"] * grad_accum * world_size
    if earlier != now:
        raise UserError(f"checkpoint {path} was made with {earlier} examples per step ({made_with['batch_size']} x "
                        f"{earlier // state['world_size'] // made_with['batch_size']} x {state['world_size']} "
                        f"process(es)), this run has {now} ({config_values['batch_size']} x {grad_accum} x "
                        f"{world_size})", f"keep batch size x accumulation x processes = {earlier}, e.g. "
                        f"--effective-batch-size {earlier}")
    if state["world_size"] != world_size and config_values.get("local_sgd_steps"):
        raise UserError(f"checkpoint {path} was made by {state['world_size']} process(es) with local SGD, whose "
                        f"processes hold weights of their own; this run has {world_size}",
                        "resume local SGD with the same number of processes")
    return state


def trim_log(log_path: Path, step: int) -> None:
    """Drop what a killed run logged after its checkpoint: those steps run again."""
    if log_path.is_file():
        keep = [line for line in log_path.read_text().splitlines() if json.loads(line).get("step", 0) <= step]
        log_path.write_text("".join(line + "\n" for line in keep))
