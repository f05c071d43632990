"""Weights as plain transformers loads them, each folder written whole or not at all: model/ (the final,
or best, weights), best/, and what the model's form saves beside model/. What each holds is the form's
(models/adapters/model_form.py: with adapters, model/ is merged into the base, adapter/ and best/ hold
peft's own folder)."""

from __future__ import annotations

import shutil
from pathlib import Path

from effitrain.outputs import files


def save_model(run, folder: Path) -> None:
    """model/: the whole model, loadable by plain transformers (an adapted one merged into its base)."""
    write_atomically(run, folder, run.form.write_model)


def save_trained(run, folder: Path) -> None:
    """best/ and what the form saves beside model/: the weights load_weights puts back (an adapted model's
    adapter alone: peft's files, the plain config and the processor)."""
    write_atomically(run, folder, run.form.write_trained)


def write_atomically(run, folder: Path, write_weights) -> None:
    """`write_weights(run, folder)` (save_pretrained: safetensors, config with id2label) and the processor,
    written into a temporary folder and renamed over `folder`, so that a kill during a save never leaves
    half a model."""
    accelerator = run.accelerator
    tmp = folder.with_name(f".tmp-{folder.name}")
    accelerator.wait_for_everyone()
    if accelerator.is_main_process and tmp.exists():
        shutil.rmtree(tmp)
    accelerator.wait_for_everyone()  # no process looks into `tmp` while it is being cleared
    try:
        with files.writing(tmp):
            write_weights(run, tmp)
        accelerator.wait_for_everyone()  # the other processes' save_pretrained also looks into `tmp`
        if accelerator.is_main_process:
            with files.writing(tmp):
                save_processor(run, tmp)
            if folder.exists():
                shutil.rmtree(folder)
            tmp.rename(folder)
    except BaseException:  # a signal or a full disk mid-save: no half model is left behind
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    accelerator.wait_for_everyone()


def save_processor(run, folder: Path) -> None:
    """The processor as prediction needs it: a text model's tokenizer truncates where training did."""
    processor = run.data.processor
    if run.task.is_text:
        processor.model_max_length = run.config.max_length
        backend = getattr(processor, "backend_tokenizer", None)
        if backend is not None and backend.padding is not None:
            # A checkpoint's tokenizer.json may pad every input to a fixed length (all-MiniLM's does);
            # tokenizing switches that off, but a resumed run reads its data from the cache and never
            # tokenizes: the saved tokenizer must be the same either way, and pad per batch.
            backend.no_padding()
    processor.save_pretrained(folder)


def load_weights(run, folder: Path) -> None:
    """Put the weights of a save_trained folder back into the run's model (--keep best)."""
    run.form.load_trained(run, folder)
