"""Weights as plain transformers loads them: model/ (the final, or best, weights) and best/; with
adapters (--peft), model/ holds them merged into the base, and adapter/ and best/ peft's own folder."""

from __future__ import annotations

import shutil
from pathlib import Path

from effitrain.models import adapters
from effitrain.outputs import files


def save_model(run, folder: Path, adapter: bool = False) -> None:
    """save_pretrained (safetensors, config with id2label, the processor), written into a temporary
    folder and renamed over `folder`, so that a kill during a save never leaves half a model.
    `adapter`: an adapted model's adapter alone (peft's files, the plain config and the processor)."""
    accelerator = run.accelerator
    tmp = folder.with_name(f".tmp-{folder.name}")
    accelerator.wait_for_everyone()
    if accelerator.is_main_process and tmp.exists():
        shutil.rmtree(tmp)
    accelerator.wait_for_everyone()  # no process looks into `tmp` while it is being cleared
    try:
        with files.writing(tmp):
            write_weights(run, tmp, adapter)
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


def write_weights(run, folder: Path, adapter: bool) -> None:
    accelerator = run.accelerator
    model = accelerator.unwrap_model(run.model)
    if not adapters.is_adapted(model):
        run.strategy.save_pretrained(run.model, folder)
        return
    if adapter:
        state = run.strategy.module_state_dict(model)  # a collective where the weights are sharded
        if accelerator.is_main_process:
            adapters.save_adapter(model, folder, state)
            adapters.plain_config(model).save_pretrained(folder)  # the labels and the task, for predict
        return
    state = adapters.merged_state_dict(model)  # on every process: FSDP gathers its shards collectively
    if accelerator.is_main_process:
        adapters.save_merged(model, run.task, folder, state)


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

    model = run.accelerator.unwrap_model(run.model)
    if adapters.is_adapted(model):
        adapters.load_adapter_weights(model, folder)
        return
    state, device = {}, run.accelerator.device
    for file in sorted(folder.glob("*.safetensors")):  # safetensors knows `cpu`, not `cpu:0` (gloo processes)
        state.update(load_file(str(file), device="cpu" if device.type == "cpu" else str(device)))
    unexpected = run.strategy.load_full_state_dict(model, state)
    if unexpected:
        raise RuntimeError(f"{folder} holds weights the model does not have: {unexpected[:3]}")
