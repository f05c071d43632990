"""One training micro-step (forward, loss, backward) run on fake tensors: every operator computes
shapes only, so the bytes of every tensor the step creates are known exactly, for any model size,
in well under a second per layer stack, with no weights allocated.

A dispatch mode sees each tensor storage as it is created and a weak reference sees it freed; the
live bytes after every operator make a timeline. Weights are counted from the model, optimizer
states by arithmetic (see `optimizer_state_bytes`): neither needs simulating.

Deep models are simulated at depth 2 and 3 and extrapolated: in a stack of identical layers each
extra layer adds the same activations (forward) and the same gradients (backward), so each phase's
peak is linear in depth. The backward is cut into its first two layers (plus the head) and its last
layer (plus the embeddings) because the backward peak sits at one of those two ends: there the
held activations are largest, here the gradients are. Two layers, not one: the top layer may be
lighter than the others (the first-token head computes one row there), so the held peak is in the
backward of the layer below it (by 1.2 MB, a 64-wide BERT in bf16 with checkpointing: its recomputation
with every lower layer's input held). `tests/integration/test_planning.py` checks the extrapolation
against a full-depth simulation.
"""

from __future__ import annotations

import contextlib
import copy
import weakref
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from effitrain import tasks
from effitrain.config import ALL_LINEAR
from effitrain.models import adapters, transforms
from effitrain.speedups import adapter_step

# glibc, as it starts, serves allocations under its largest mmap threshold (32 MiB on 64-bit) from its
# heaps, which keep freed memory resident; bigger ones are mapped and unmapped each time, unless the run
# keeps freed memory (speedups/allocator.py: every block from the heap). The CPU overhead model counts
# what the forward and the backward allocate of each kind (see planner.CPU_OVERHEAD).
HEAP_LIMIT = 32 * 2**20
# Autocast dtypes of the half precisions (fp32 runs without autocast).
AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Phases:
    """Peaks (bytes above the weights) of the three phases of a micro-step.

    `_held`: activations and temporaries; `_with_grads`: plus the gradients made so far (the first
    micro-batch of a step, when no gradient exists before the backward)."""

    forward_held: int
    first_held: int
    first_with_grads: int
    last_held: int
    last_with_grads: int
    forward_heap_churn: int  # bytes the forward allocates in heap-sized pieces (CPU overhead model)
    forward_large_churn: int  # ... and in pieces of HEAP_LIMIT or more (glibc maps them, unless told not to)
    backward_heap_churn: int  # the same two for the backward (checkpointing's recomputation included)
    backward_large_churn: int
    flops: int

    def peak(self, grads_before: int) -> int:
        """Highest bytes above the weights; `grads_before`: gradients already held when the
        micro-batch starts (a later micro-batch of an accumulated step holds them all)."""
        if grads_before:
            return grads_before + max(self.forward_held, self.first_held, self.last_held)
        return max(self.forward_held, self.first_with_grads, self.last_with_grads)

    @staticmethod
    def extrapolate(at2: "Phases", at3: "Phases", depth: int) -> "Phases":
        return Phases(**{name: max(0, round(getattr(at3, name) + (depth - 3) * (getattr(at3, name) - getattr(at2, name))))
                         for name in Phases.__dataclass_fields__})


class _Timeline(TorchDispatchMode):
    """Live bytes of the storages created inside the mode (not the weights), after every operator."""

    def __init__(self, flop_counter, trace: list | None = None):
        super().__init__()
        # `trace`: where to record the ordered allocations (id, bytes) and frees (id, 0) of the step's
        # storages, for a replay through the C allocator (benchmarks/planner/memory_overhead.py); None: not recorded.
        self.trace = trace
        self._next_id = 0
        self.held = 0  # activations and temporaries
        self.grads = 0
        self.points: list[tuple[int, int]] = []
        self.heap_churn = 0
        self.large_churn = 0
        self.flops = 0
        self._flop_registry = flop_counter
        self._sizes = WeakIdKeyDictionary()  # storage -> [bytes, is_grad, id]

    def _freed(self, record):
        if self.trace is not None:
            self.trace.append((record[2], 0))
        if record[1]:
            self.grads -= record[0]
        else:
            self.held -= record[0]

    def mark_grad(self, tensor: torch.Tensor) -> None:
        record = self._sizes.get(tensor.untyped_storage())
        if record is not None and not record[1]:
            record[1] = True
            self.held -= record[0]
            self.grads += record[0]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        count = self._flop_registry.get(func._overloadpacket)
        if count is not None:
            self.flops += count(*args, **kwargs, out_val=out)
        for tensor in tree_leaves(out):
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = tensor.untyped_storage()
            if storage in self._sizes:
                continue
            size = storage.nbytes()
            record = [size, False, self._next_id]
            if self.trace is not None:
                self.trace.append((self._next_id, size))
            self._next_id += 1
            self._sizes[storage] = record
            weakref.finalize(storage, self._freed, record)
            self.held += size
            if size < HEAP_LIMIT:
                self.heap_churn += size
            else:
                self.large_churn += size
        self.points.append((self.held, self.grads))
        return out


def layer_stack(model: torch.nn.Module) -> torch.nn.ModuleList | None:
    """The ModuleList of repeated layers holding most parameters (encoder.layer, model.layers, h...)."""
    best, best_count = None, 0
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) >= 1:
            count = sum(p.numel() for p in module.parameters())
            if count > best_count:
                best, best_count = module, count
    return best


def with_depth(config, depth: int):
    """A copy of a transformers config with `depth` layers (per-layer lists cut to match)."""
    config = copy.deepcopy(config)
    config.num_hidden_layers = depth
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = config.layer_types[:depth]
    return config


def depth_of(config) -> int | None:
    return getattr(config, "num_hidden_layers", None)


def task_of(task):
    """A task name's task object, or a task object as given: online RL's (tasks/online_rl.py), whose loss
    is its objective's (planning/rl_step.py), is not a registered name's."""
    return tasks.get(task) if isinstance(task, str) else task


def example_batch(task, config, batch_size: int, seq_len: int) -> dict:
    """Inputs of the shapes a training micro-batch has (values do not matter to memory)."""
    return task_of(task).example_batch(config, batch_size, seq_len)


def build(task, config):
    """The task's Auto model from `config`, its tensors fake (no memory), before the transforms."""
    return task_of(task).auto_class.from_config(config)


def settings(task, checkpointing: bool, peft=None, packing: bool = False) -> transforms.Settings:
    """The training model's transforms as the planner applies them (models/transforms.py): those `train`
    applies, the CPU speed-ups included (fast dropout keeps its masks and the first-token head drops the
    other tokens' head activations: the default model at 24 x 128 holds 753 MiB where transformers' own
    layers hold 883, measured on real tensors; simulated 755); not oneDNN linear layers (device "meta"),
    which fake tensors run as plain ones. `packing` as training has it: a packed run keeps the whole head
    (its rows hold several examples, each read at its own first token)."""
    return transforms.Settings(task_of(task), "meta", checkpointing, packing,
                               peft=peft if adapters.method(peft) else None)


def micro_step(task, config, batch_size: int, seq_len: int, precision: str, checkpointing: bool,
               peft=None, packing: bool = False, loss_positions: int | None = None, sharded: bool = False) -> Phases:
    """Simulate forward + loss + backward of one micro-batch; extrapolated in depth where possible.
    `task`: a task name, or a task object (`task_of`); `batch_size`: the micro-batch's rows.
    `peft`: the adapter settings (plan.Peft) a LoRA or QLoRA run applies, or None; `packing`: the model a
    packed run trains (the batch keeps padded shapes: `train --memory-budget` refuses --packing);
    `loss_positions`: a causal LM's positions with a loss per row (answer-only data), None: all;
    `sharded`: the weights sharded across processes (fsdp, deepspeed: transforms.Settings.sharded)."""
    depth = depth_of(config)
    model = {"peft": peft, "packing": packing, "sharded": sharded, "loss_positions": loss_positions}
    if depth is not None and depth > 3:
        at2 = _simulate(task, with_depth(config, 2), batch_size, seq_len, precision, checkpointing, **model)
        at3 = _simulate(task, with_depth(config, 3), batch_size, seq_len, precision, checkpointing, **model)
        if at2 is not None and at3 is not None:
            return Phases.extrapolate(at2, at3, depth)
    return _simulate(task, config, batch_size, seq_len, precision, checkpointing, split=False, **model)


_MODELS: dict = {}  # (task, config as JSON, checkpointing) -> (fake mode, model): built once per planning


# Random structure (layers dropped, time steps masked) depends on drawn values, which fake tensors
# do not have: simulated off, the worst case for memory (every layer runs, nothing is masked).
RANDOM_STRUCTURE = {"layerdrop": 0.0, "mask_time_prob": 0.0, "mask_feature_prob": 0.0}


def _fake_model(task, config, checkpointing, peft=None, precision="fp32", packing=False):
    from torch._subclasses.fake_tensor import FakeTensorMode

    config = copy.deepcopy(config)
    for key_, value in RANDOM_STRUCTURE.items():
        if hasattr(config, key_):
            setattr(config, key_, value)
    adapted = adapters.method(peft) is not None
    # QLoRA's stand-in layers compute in the training precision (bitsandbytes' compute dtype).
    key = (task_of(task).name, config.to_json_string(use_diff=False), checkpointing, peft if adapted else None,
           precision if adapters.quantized(peft) else None, packing)
    if key not in _MODELS:
        if len(_MODELS) > 16:
            _MODELS.clear()
        mode = FakeTensorMode(allow_non_fake_inputs=False)
        if adapted:
            model = _fake_adapted(mode, task, config, checkpointing, peft, precision, packing)
        else:
            with mode:
                model = build(task, config)
                model.train()
                model, _ = transforms.apply_all(model, settings(task, checkpointing, packing=packing))
        _MODELS[key] = (mode, model)
    return _MODELS[key]


# -- adapters (--peft) ----------------------------------------------------------------------------------
def adapted_on_meta(task: str, config, peft, checkpointing: bool = False, packing: bool = False):
    """The model `train --peft` trains (its transforms, adapters included), on the meta device (peft
    moves modules with .to(), which fake parameters refuse), and the names of the linear layers QLoRA
    stores in 4 bits: those bitsandbytes converts on load (not the task's head, which is trained, nor
    what transformers keeps in full precision: tied and output embeddings)."""
    from transformers.quantizers.base import get_keys_to_not_convert

    with torch.device("meta"):
        model = build(task, config)
    if getattr(peft, "new_tokens", 0):  # the rows a chat template added, marked as tasks/causal_lm.py marks them
        rows = model.get_input_embeddings().weight.shape[0]
        adapters.mark_new_tokens(model, {i: f"<added {i}>" for i in range(rows - peft.new_tokens, rows)})
    head = adapters.head_modules(model) if task_of(task).has_labels else []
    quantized = []
    if adapters.quantized(peft):
        keep = set(get_keys_to_not_convert(model)) | set(head)
        quantized = [name for name in adapters.targets(model, ALL_LINEAR, head)
                     if not any(name == k or name.startswith(f"{k}.") for k in keep)]
    model.train()
    layers = dict(model.named_modules())
    quantized = {name: layers[name] for name in quantized}
    model, _ = transforms.apply_all(model, settings(task, checkpointing, peft, packing))
    return model, quantized


def _fake_adapted(mode, task, config, checkpointing, peft, precision, packing=False):
    """The adapted model with fake tensors in place of its meta ones (shared parameters stay shared);
    QLoRA's 4-bit layers replaced by stand-ins that allocate what bitsandbytes' do."""
    model, quantized = adapted_on_meta(task, config, peft, checkpointing, packing)
    fakes: dict[int, torch.Tensor] = {}

    def fake(tensor, parameter):
        if id(tensor) not in fakes:
            with mode:
                empty = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="cpu")
            fakes[id(tensor)] = torch.nn.Parameter(empty, requires_grad=tensor.requires_grad) if parameter else empty
        return fakes[id(tensor)]

    for module in model.modules():
        for name, value in module._parameters.items():
            if value is not None:
                module._parameters[name] = fake(value, True)
        for name, value in module._buffers.items():
            if value is not None:
                module._buffers[name] = fake(value, False)
    compute = AUTOCAST_DTYPES.get(precision, torch.float32)
    for module in quantized.values():
        module.forward = _Linear4bitStandIn(module, compute)
    model.train()
    return model


class _MatMul4bit(torch.autograd.Function):
    """bitsandbytes' MatMul4Bit (autograd/_functions.py) as memory sees it: the forward dequantises
    the whole weight to the compute dtype for one matmul (CPU: gemm_4bit's default kernel; the CUDA
    kernel for large inputs does the same), the backward dequantises it again (to the load dtype,
    fp32, then to the gradient's dtype) for the input's gradient; nothing of the input is kept."""

    @staticmethod
    def forward(ctx, x, weight, bias, transposed):
        ctx.weight, ctx.transposed = weight, transposed  # the packed weight: a parameter, not a new tensor
        return torch.nn.functional.linear(x, _dequantised(weight, x.dtype, transposed), bias)

    @staticmethod
    def backward(ctx, grad):
        dense = _dequantised(ctx.weight, torch.float32, ctx.transposed).to(grad.dtype)
        return grad @ dense, None, None, None


def _dequantised(weight, dtype, transposed):
    """A new dense (out, in) weight, and the double-quantised absmax's two temporaries before it."""
    out_features, in_features = weight.shape[::-1] if transposed else weight.shape
    blocks = -(-weight.numel() // 64)
    absmax = torch.empty(blocks, dtype=torch.float32) + 0.0  # dequantize_blockwise, then + offset
    del absmax
    return torch.empty(out_features, in_features, dtype=dtype)


class _Linear4bitStandIn:
    """bitsandbytes' Linear4bit.forward on a plain frozen layer (nn.Linear, or GPT-2's Conv1D, which
    bitsandbytes stores as a transposed Linear): the input cast to the compute dtype, the 4-bit
    matmul, the result cast back; then peft's 4-bit LoRA layer's defensive clone of the result."""

    def __init__(self, module, compute):
        self.module, self.compute = module, compute
        self.transposed = not isinstance(module, torch.nn.Linear)

    def __call__(self, x):
        bias = self.module.bias
        with torch.autocast("cpu", enabled=False):
            out = _MatMul4bit.apply(x.to(self.compute), self.module.weight,
                                    None if bias is None else bias.to(self.compute), self.transposed)
        return out.to(x.dtype).clone()


def _simulate(task, config, batch_size, seq_len, precision, checkpointing, split=True, peft=None,
              packing=False, trace: list | None = None, sharded: bool = False,
              loss_positions: int | None = None) -> Phases | None:
    from torch.utils.flop_counter import flop_registry

    mode, model = _fake_model(task, config, checkpointing, peft, precision, packing)
    model.zero_grad(set_to_none=True)
    # The adapters' half-precision casts, kept across steps as training keeps them (not when sharded or
    # checkpointing): made afresh in this step, so that it counts them (a fake model is reused).
    adapter_step.keep_half_casts(model, adapter_step.keeps_half_casts(sharded, checkpointing))
    with mode:
        stack = layer_stack(model) if split else None
        if split and (stack is None or len(stack) != depth_of(config)):
            return None  # no stack of identical layers to extrapolate over
        batch = example_batch(task, model.config, batch_size, seq_len)
        timeline = _Timeline(flop_registry, trace)
        # Which backward point each layer's gradients complete at: cuts the backward into phases.
        done_at: dict[int, int] = {}
        remaining = {i: sum(1 for p in layer.parameters() if p.requires_grad) for i, layer in enumerate(stack or [])}
        if split and not all(remaining.values()):
            return None  # a layer trains nothing (adapters on some layers only): no end to cut at

        def on_grad(param, layer_index=None):
            timeline.mark_grad(param.grad)
            if layer_index is not None:
                remaining[layer_index] -= 1
                if remaining[layer_index] == 0:
                    done_at[layer_index] = len(timeline.points)

        owner = {id(p): i for i, layer in enumerate(stack or []) for p in layer.parameters()}
        handles = [p.register_post_accumulate_grad_hook(lambda p, i=owner.get(id(p)): on_grad(p, i))
                   for p in model.parameters() if p.requires_grad]
        autocast = (torch.autocast("cpu", dtype=AUTOCAST_DTYPES[precision]) if precision in AUTOCAST_DTYPES
                    else contextlib.nullcontext())
        with timeline:
            with autocast:
                loss = task_of(task).planned_loss_sum(model, batch, loss_positions) / batch_size
            backward_start = len(timeline.points)
            forward_heap_churn, forward_large_churn = timeline.heap_churn, timeline.large_churn
            loss.backward()
            del loss
            backward_heap_churn = timeline.heap_churn - forward_heap_churn
            backward_large_churn = timeline.large_churn - forward_large_churn
        timeline.trace = None  # the gradients' frees come with the next simulation's zero_grad
        for handle in handles:
            handle.remove()
    points = timeline.points
    forward = points[:backward_start] or [(0, 0)]
    if split:
        top = len(stack) - 1
        first = points[backward_start:done_at[top - 1] + 1]  # the top two layers (see the module's doc)
        last = points[done_at[1]:] if 1 in done_at else points[backward_start:]
    else:
        first = last = points[backward_start:] or [(0, 0)]
    return Phases(forward_held=max(h for h, _ in forward),
                  first_held=max(h for h, _ in first), first_with_grads=max(h + g for h, g in first),
                  last_held=max(h for h, _ in last), last_with_grads=max(h + g for h, g in last),
                  forward_heap_churn=forward_heap_churn, forward_large_churn=forward_large_churn,
                  backward_heap_churn=backward_heap_churn, backward_large_churn=backward_large_churn,
                  flops=timeline.flops)



def inference_peak(task, config, batch_size: int, seq_len: int, precision: str) -> int:
    """The most bytes above the weights that one forward of `batch_size` rows holds in evaluation mode without
    gradients (a teacher's pass over the data, tasks/distillation.py): each layer's activations are freed once
    the next has read them, so the peak is one layer's temporaries and the logits, not the depth's."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import flop_registry

    config = copy.deepcopy(config)
    for key_, value in RANDOM_STRUCTURE.items():
        if hasattr(config, key_):
            setattr(config, key_, value)
    with FakeTensorMode(allow_non_fake_inputs=False):
        model = build(task, config).eval().requires_grad_(False)
        batch = example_batch(task, model.config, batch_size, seq_len)
        timeline = _Timeline(flop_registry)
        autocast = (torch.autocast("cpu", dtype=AUTOCAST_DTYPES[precision]) if precision in AUTOCAST_DTYPES
                    else contextlib.nullcontext())
        with torch.no_grad(), timeline, autocast:
            model(**task_of(task).inputs(batch)).logits.float()
    return max((held for held, _ in timeline.points), default=0)
