"""A saved model directory read back for `predict` and `evaluate`: its processor and its model, built for
the task it was made for (commands/saved_model.py finds the directory and that task)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from effitrain.models import adapters, loading


@dataclass
class SavedModel:
    path: Path
    task: object  # tasks.base.Task
    processor: object  # tokenizer, image processor or feature extractor
    model: object  # the task's Auto model, in eval mode, on the CPU


def check_adapter_base(path: Path) -> None:
    """For an adapter folder: its base found, and its architecture and shapes checked (its weights are
    hashed when it loads), so that a wrong base is refused before any weights or data load."""
    if adapters.is_adapter_dir(path):
        adapters.base_of(path, weights=False)


def load(path: Path, task) -> SavedModel:
    processor = task.load_processor(loading.ModelSource(path))
    return SavedModel(path, task, processor, build(path, task, processor).eval())


def build(path: Path, task, processor):
    """The saved model, head as it is (no labels given); an adapter folder (adapter/, best/ of a --peft
    run) is applied to its base model and merged. A causal LM's loss is computed as in training, without
    the whole logits (speedups/chunked_lm_loss.py)."""
    if adapters.is_adapter_dir(path):
        model = adapters.load_for_inference(path, task)
    else:
        model = task.build_model(loading.ModelSource(path), None, processor)
    if task.chunked_loss:
        from effitrain.speedups import chunked_lm_loss  # torch: not on the CLI's parse path

        chunked_lm_loss.apply(model)
    return model


def text_max_length(processor, model_config) -> int:
    """Where a text model's inputs are cut: the saved tokenizer's model_max_length (`effitrain train`
    sets it to its --max-length), else the model's position limit when the tokenizer has none."""
    limit = getattr(processor, "model_max_length", None)
    if isinstance(limit, int) and 0 < limit < 1_000_000:  # tokenizers without a limit hold about 1e30
        return limit
    return getattr(model_config, "max_position_embeddings", None) or 512


def label_names(model_config) -> list[str]:
    """The model's labels in the order of its output units."""
    return [model_config.id2label[i] for i in range(model_config.num_labels)]


def device():
    """Where prediction runs: this process's accelerator (CUDA, MPS, XPU, ...) if it has one, else the
    CPU. torch answers this without importing accelerate, which `predict` does not need."""
    import torch

    if not torch.accelerator.is_available():
        return torch.device("cpu")
    kind = torch.accelerator.current_accelerator()
    return torch.device(kind.type, torch.accelerator.current_device_index())
