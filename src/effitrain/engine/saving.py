"""Weights as plain transformers loads them: model/ (the final, or best, weights) and best/."""

from __future__ import annotations

import shutil
from pathlib import Path


def save_model(run, folder: Path) -> None:
    """save_pretrained (safetensors, config with id2label, the processor), written into a temporary
    folder and renamed over `folder`, so that a kill during a save never leaves half a model."""
    accelerator = run.accelerator
    tmp = folder.with_name(f".tmp-{folder.name}")
    accelerator.wait_for_everyone()
    if accelerator.is_main_process and tmp.exists():
        shutil.rmtree(tmp)
    accelerator.wait_for_everyone()  # no process looks into `tmp` while it is being cleared
    try:
        accelerator.unwrap_model(run.model).save_pretrained(
            tmp, is_main_process=accelerator.is_main_process, save_function=accelerator.save,
            state_dict=accelerator.get_state_dict(run.model), safe_serialization=True)
        accelerator.wait_for_everyone()  # the other processes' save_pretrained also looks into `tmp`
        if accelerator.is_main_process:
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
    """Put the weights of a save_model folder back into the run's model (--keep best)."""
    from safetensors.torch import load_file

    state = {}
    for file in sorted(folder.glob("*.safetensors")):
        state.update(load_file(str(file), device=str(run.accelerator.device)))
    model = run.accelerator.unwrap_model(run.model)
    unexpected = model.load_state_dict(state, strict=False).unexpected_keys
    if unexpected:
        raise RuntimeError(f"{folder} holds weights the model does not have: {unexpected[:3]}")
