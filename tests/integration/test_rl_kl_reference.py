"""Online RL's KL reference holds no second model with --peft (issue 43): the reference is the policy with its
adapters switched off. Counted here in the process itself (the weights every live module holds, each storage
once) and by the planner of the run; and, in fresh processes, by the peak resident set of --kl-beta 0.1
against --kl-beta 0 with a model whose weights (208 MB) a second copy would make plainly visible. Without
--peft the reference is a frozen copy, and both counts see it."""

import gc
import itertools
import json
import os
import subprocess
import sys

import effitrain
import pytest
import torch
from effitrain.tasks import reference
from torch._subclasses.fake_tensor import FakeTensor

from conftest import as_flags

# Odd widths, so that no other test's module shares a weight's shape.
TINY_LLAMA = ("llama:hidden_size=24,num_hidden_layers=2,num_attention_heads=2,num_key_value_heads=2,"
              "intermediate_size=40,max_position_embeddings=64")


def run_settings(out, **more) -> dict:
    return {**dict(model=TINY_LLAMA, task="causal-lm", data="addition", rl="grpo", num_generations=2,
                   max_new_tokens=2, max_train_samples=4, max_eval_samples=2, batch_size=2, max_steps=1,
                   precision="fp32", output_dir=str(out)), **more}


def weight_storages(shapes: set) -> dict[int, int]:
    """{storage address: bytes} of every parameter and buffer of a live nn.Module whose shape is in `shapes`
    (the run freezes what it built, speedups/process_tuning.py: unfrozen to be listed, then frozen again)."""
    gc.unfreeze()
    gc.collect()
    modules = [obj for obj in gc.get_objects() if isinstance(obj, torch.nn.Module)]
    gc.freeze()
    held = {}
    for module in modules:
        for tensor in itertools.chain(module.parameters(recurse=False), module.buffers(recurse=False)):
            # meta and fake tensors (the planner's model) hold no memory
            if tuple(tensor.shape) in shapes and tensor.device.type != "meta" and not isinstance(tensor, FakeTensor):
                held[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
    return held


class AfterTheFirstStep:
    """On the first step's end (the reference's log-probs were taken in it): the reference, the bytes of the
    model's own weights (base and adapters; the base alone), and of every weight of their shapes that a live
    module holds, and whether each of those is the model's. Keeps nothing of the run after it."""

    def on_train_begin(self, job):
        self.job = job

    def on_step_end(self, state, result):
        model, held_reference = self.job.model, self.job.task.objective.reference
        self.reference = type(held_reference)
        self.reference_holds = [name for name, value in (vars(held_reference) if held_reference else {}).items()
                                if isinstance(value, (torch.nn.Module, torch.Tensor))]
        tensors = list(itertools.chain(model.parameters(), model.buffers()))
        own = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
        self.own_bytes = sum(own.values())
        self.base_bytes = sum(t.numel() * t.element_size() for name, t in model.named_parameters()
                              if "lora_" not in name) + sum(b.numel() * b.element_size() for b in model.buffers())
        held = weight_storages({tuple(t.shape) for t in tensors})
        self.held_bytes, self.others = sum(held.values()), held.keys() - own.keys()
        del self.job


def trained(tmp_path, name: str, **more):
    """A one-step run watched by AfterTheFirstStep; what it saw, its planned peak, its step's log record."""
    seen = AfterTheFirstStep()
    effitrain.train(run_settings(tmp_path / name, memory_budget="64GiB", **more), callbacks=[seen])
    metrics = json.loads((tmp_path / name / "metrics.json").read_text())
    log = [json.loads(line) for line in (tmp_path / name / "log.jsonl").read_text().splitlines()]
    return seen, metrics["memory_plan"]["predicted_peak_bytes"], next(r for r in log if "loss" in r and "split" not in r)


def test_lora_reference_is_the_adapters_switched_off_and_no_copy(tmp_path):
    lora, lora_plan, lora_step = trained(tmp_path, "lora-kl", peft="lora", kl_beta=0.1)
    assert lora.reference is reference.AdaptersOff and not lora.reference_holds and "kl" in lora_step
    # Every live weight of the model's shapes is the model's own: no second copy anywhere in the process.
    assert not lora.others and lora.held_bytes == lora.own_bytes
    # The planner counts no copy either: only the KL term's own tensors (a few per-token values, bytes) on top.
    assert abs(lora_plan - trained(tmp_path, "lora", peft="lora")[1]) < 1e-3 * lora.own_bytes

    full, full_plan, full_step = trained(tmp_path, "full-kl", kl_beta=0.1)
    assert full.reference is reference.FrozenCopy and full.reference_holds == ["model"] and "kl" in full_step
    assert full.held_bytes == 2 * full.own_bytes  # the policy and its frozen copy, nothing more
    # The copy, planned to the byte, and the KL term's own few tensors.
    assert abs(full_plan - trained(tmp_path, "full")[1] - full.base_bytes) < 1e-3 * full.base_bytes


def started(out, kl_beta: str) -> subprocess.Popen:
    """`train --peft lora --kl-beta kl_beta` of the big model in a new process, its output in out.txt."""
    out.mkdir()
    flags = as_flags(run_settings(out / "run", model=BIG_LLAMA, peft="lora", kl_beta=kl_beta, max_eval_samples=1))
    with open(out / "out.txt", "w") as output:
        return subprocess.Popen([sys.executable, "-m", "effitrain", "train", *flags], stdout=output,
                                stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})


# 52M parameters: 208 MB in fp32, about a quarter of a run's peak resident set.
BIG_LLAMA = ("llama:hidden_size=512,num_hidden_layers=8,num_attention_heads=8,num_key_value_heads=8,"
             "intermediate_size=1024,max_position_embeddings=64")
WEIGHT_BYTES = 4 * (2 * 30522 * 512 + 8 * (4 * 512 * 512 + 3 * 512 * 1024 + 2 * 512) + 512)


@pytest.mark.slow
def test_lora_with_kl_peaks_within_10_percent_of_no_kl(tmp_path):
    """Two runs at once, each in its own process; each one's peak resident set as the run measured it (its own
    process's ru_maxrss, metrics.json's peak_memory_bytes: wait4's would also take any process it waited for)."""
    jobs = {kl: started(tmp_path / f"kl-{kl}", kl) for kl in ("0", "0.1")}
    peaks = {}
    for kl, job in jobs.items():
        assert job.wait(timeout=600) == 0, (tmp_path / f"kl-{kl}" / "out.txt").read_text()[-3000:]
        peaks[kl] = json.loads((tmp_path / f"kl-{kl}" / "run" / "metrics.json").read_text())["peak_memory_bytes"]
    assert "KL beta 0.1 (reference: the adapters switched off)" in (tmp_path / "kl-0.1" / "out.txt").read_text()
    assert abs(peaks["0.1"] - peaks["0"]) <= 0.1 * peaks["0"], peaks
    assert WEIGHT_BYTES > 0.15 * peaks["0"], peaks  # a second copy of the weights would break the bound
