"""Peak memory per device of a training configuration, before anything is loaded, and the choice of
settings that fit a budget.

    peak = weights + gradients + optimizer states + activations + overhead

- weights, gradients, optimizer states: exact arithmetic on the model's parameter shapes (the model
  is built on fake tensors: no weights are read or allocated), divided by the processes where the
  strategy shards them;
- activations (and the temporaries of the forward, the loss and the backward): simulated operator
  by operator on fake tensors (planning/simulate.py);
- overhead: on CPU, what the C allocator keeps resident beyond live tensors, calibrated by
  measurement for the allocator that serves the process (CPU_OVERHEAD for glibc's, PRELOADED_OVERHEAD for
  tcmalloc's and jemalloc's; method in benchmarks/README.md); on CUDA, the context and caching
  allocator slack (a documented allowance, not counted by torch.cuda.max_memory_allocated).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import torch

from effitrain import optimizers, tasks
from effitrain.config import accepted_optimizers, shards_weights
from effitrain.errors import UserError
from effitrain.models import adapters, blocks, loading, student
from effitrain.models.adapters import Peft  # the adapter settings planned (`plan.Peft`)
from effitrain.planning import simulate

GiB = 2**30
MiB = 2**20

# CPU resident memory beyond the live tensors = CONSTANT + CHURN_SHARE x the step's heap churn. glibc keeps
# the free space of its heap (every piece: effitrain's CPU runs keep freed memory, see heap_churn), cut into
# holes by the small objects (autograd nodes, tensor headers) left between the tensors: it grows with the
# bytes a micro-step passes through the heap, forward and backward (checkpointing's recomputation
# included). The constant: what a run builds after its plan besides the model's tensors (the planner's own
# objects, the loaders); the libraries a run's adapters, optimizer and strategy use are imported before the
# plan's baseline (memory_fit.plan_run, Fsdp.setup_environment), so they are not in it. Least squares on
# effitrain's own runs (benchmarks/memory_plan.py --runs, the 12 `fit` rows: peak RSS minus the RSS at
# planning; xeon2c, 2026-12-05); the held-out rows: benchmarks/results/memory_plan_xeon2c_2026-12-05.md.
CPU_OVERHEAD = {"constant": 152 * MiB, "churn_share": 0.115}
# Under an allocator that keeps small objects apart from large blocks (the `effitrain` command preloads one:
# speedups/allocator.py), the freed blocks are reused whole and the overhead is a near constant, whatever
# the churn: least squares on the same rows run under each (benchmarks/memory_plan.py --runs --calibrate).
PRELOADED_OVERHEAD = {"jemalloc": 89 * MiB, "tcmalloc": 61 * MiB}
# CUDA: the context (kernels, cuBLAS/cuDNN workspaces) is outside max_memory_allocated; the caching
# allocator rounds and fragments. Allowances from PyTorch's documentation and common practice, not
# measured here (no GPU was lent to this project yet).
CUDA_OVERHEAD = {"context": 600 * MiB, "fragmentation": 0.05}

# Share of a training step's time spent in matmuls (what half precision speeds up): effitrain bench
# measured bf16 steps 1.66x faster where bf16 matmuls are 3.5x faster on this CPU, i.e. about 0.6.
MATMUL_TIME_SHARE = 0.6
# bf16/fp16 vs fp32 matmul throughput on GPUs with tensor cores (A100/H100 class): an assumption until
# measured on a lent GPU; on CPU it is measured at plan time (devices.bf16_matmul_speedup).
GPU_HALF_SPEEDUP = 2.0

BNB_4BIT_BLOCK = 64  # QLoRA's 4-bit weights: values per block (transformers' default blocksize)


def bnb_4bit_bytes(shape: tuple[int, ...]) -> int:
    """A weight as bitsandbytes stores it in NF4 with double quantisation (Params4bit + QuantState):
    two values a byte; per block of 64 an 8-bit absmax; per 256 of those an fp32 absmax and their
    offset; the 256-value fp32 map of the absmax quantisation and the 16-value NF4 map."""
    n = math.prod(shape)
    blocks = math.ceil(n / BNB_4BIT_BLOCK)
    return math.ceil(n / 2) + blocks + 4 * math.ceil(blocks / 256) + 4 + 4 * 256 + 4 * 16


@dataclass
class ModelShapes:
    """What the arithmetic needs from the model: parameter shapes, buffer bytes, the biggest layer."""

    config: object
    task: str
    param_shapes: list[tuple[tuple[int, ...], bool]]  # (shape, trainable)
    buffer_bytes: int
    largest_layer_params: int
    supports_checkpointing: bool = True
    peft: Peft | None = None  # LoRA or QLoRA: the adapted model's shapes; the simulation applies them too
    quantized: list[tuple[int, ...]] | None = None  # QLoRA: the weights stored in 4 bits
    block_matrices: list[tuple[int, ...]] | None = None  # trainable 2-D weights inside the blocks (muon's)
    packing: bool = False  # --packing: the model a packed run trains (simulate.settings)
    root_params: int = 0  # outside the transformer blocks (embeddings, head): fsdp's root unit (models/blocks.py)
    rows_per_example: int = 1  # --preference: a pair is two sequences (chosen and rejected) in one forward
    reference_bytes: int = 0  # --reference copy: a frozen copy of the weights on every device
    loss_positions: int | None = None  # answer-only causal-LM data: the most positions with a loss in a row
    step_task: object = None  # the task object whose loss a micro-step runs, where not `task`'s (online RL's)

    @property
    def weight_bytes(self) -> int:
        """fp32 parameters, QLoRA's 4-bit weights as bitsandbytes stores them."""
        quantized = self.quantized or []
        return (4 * (self.parameters - sum(math.prod(s) for s in quantized))
                + sum(bnb_4bit_bytes(s) for s in quantized))

    @property
    def parameters(self) -> int:
        return sum(math.prod(s) for s, _ in self.param_shapes)

    @property
    def trainable(self) -> int:
        return sum(math.prod(s) for s, t in self.param_shapes if t)


def model_shapes(task: str, model: str, num_labels: int = 2, vocab_size: int | None = None,
                 peft: Peft | None = None, packing: bool = False, student_layers: int | None = None) -> ModelShapes:
    """--model as `effitrain train` takes it (default, a directory, a cached hub id, a config.json or
    model_type:key=value), built on fake tensors. `vocab_size`: the tokenizer's, which `train` gives
    a text model built from a config, and to which a causal LM grows (a chat template's tokens). `peft`:
    with LoRA or QLoRA, the adapted model (built on the meta device: peft moves modules, which fake
    tensors refuse), only its adapters, head and new tokens' rows trainable. `student_layers`: the student
    --student-layers makes of it (models/student.py), built from its config."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    config = model_config(model, task, num_labels, vocab_size, student_layers)
    tasks.get(task).check_supported(config)
    quantized = None
    own = getattr(config, "vocab_size", None)
    grown = vocab_size - own if tasks.get(task).grows_vocabulary and vocab_size and isinstance(own, int) else 0
    if grown > 0:  # a pretrained model whose tokenizer gained tokens (a chat template's): training resizes it
        config.vocab_size = vocab_size
        if adapters.method(peft):
            peft = replace(peft, new_tokens=grown)  # whose rows the adapters train in full
    if adapters.method(peft):
        built, layers = simulate.adapted_on_meta(task, config, peft, packing=packing)
        quantized = [tuple(layer.weight.shape) for layer in layers.values()]
    else:
        peft = None
        with FakeTensorMode():
            built = simulate.build(task, config)
    stack = simulate.layer_stack(built)
    largest = max((sum(p.numel() for p in layer.parameters()) for layer in stack), default=0) if stack else 0
    inner = built.get_base_model() if peft else built
    in_blocks = {id(p) for block in blocks.blocks(built) for p in block.parameters()}
    return ModelShapes(inner.config, task, [(tuple(p.shape), p.requires_grad) for p in built.parameters()],
                       sum(b.numel() * b.element_size() for b in built.buffers()), largest,
                       bool(getattr(built, "supports_gradient_checkpointing", False)), peft, quantized,
                       block_matrices=[tuple(p.shape) for b in blocks.blocks(built) for p in b.parameters()
                                       if p.requires_grad and p.ndim == 2],
                       packing=packing, root_params=sum(p.numel() for p in built.parameters() if id(p) not in in_blocks))


def for_preference(shapes: ModelShapes, preference: str | None, reference: str | None) -> ModelShapes:
    """--preference: two rows per pair; what the reference holds on the device: --reference copy the weights
    again (and their buffers), precompute and adapters nothing (a column of the data; the same weights)."""
    if preference is None:
        return shapes
    from dataclasses import replace

    held = shapes.weight_bytes + shapes.buffer_bytes if reference == "copy" else 0
    return replace(shapes, rows_per_example=2, reference_bytes=held)


def model_config(model: str, task: str, num_labels: int = 2, vocab_size: int | None = None,
                 student_layers: int | None = None):
    """The transformers config of --model, with the head `effitrain train` would give it; `vocab_size`
    replaces the vocabulary of a model built from a config (as `train` does with the tokenizer's);
    `student_layers`: the config of the student --student-layers makes of it."""
    from transformers import AutoConfig

    source = loading.resolve_source(model, allow_pickle=True)  # only the config is read
    student.check_source(source, student_layers, tasks.get(task).build_on_meta)
    if source.config is not None:
        config = source.config
        if vocab_size is not None:
            config.vocab_size = vocab_size
    else:
        with loading.loading(source.path):
            config = AutoConfig.from_pretrained(str(source.path), local_files_only=True)
    config.num_labels = num_labels
    if student_layers is not None:
        config = student.student_config(config, student_layers)
    if tasks.get(task).is_text and getattr(config, "pad_token_id", None) is None:
        config.pad_token_id = 0  # sequence classification needs one to find the last token
    return config


def optimizer_state_bytes(name: str, shapes: list[tuple[int, ...]], block_matrices=()) -> int:
    """Bytes of the optimizer's state for trainable parameters of these shapes, as its library stores it
    (its spec's arithmetic: optimizers/state_sizes.py); `block_matrices`: the 2-D ones inside the blocks."""
    return optimizers.get(name).state_bytes(shapes, list(block_matrices))


def optimizer_step_temporary_bytes(name: str, shapes: list[tuple[int, ...]], weight_decay: bool = True) -> int:
    """Transient bytes inside optimizer.step() (its spec's: fused AdamW and bitsandbytes work in place;
    torch's foreach SGD copies the decayed gradients; Adafactor makes a few tensors per parameter in turn)."""
    return optimizers.get(name).step_temporary_bytes(shapes, weight_decay)


@dataclass
class Setting:
    precision: str  # fp32 | bf16 | fp16
    optimizer: str
    checkpointing: bool
    micro_batch: int
    accumulation: int


@dataclass
class Estimate:
    setting: Setting
    weights: int
    gradients: int
    optimizer: int
    activations: int
    overhead: int
    relative_speed: float
    fits: bool | None = None
    peak_phase: str | None = None  # a step with phases (online RL: generation, update): the one that peaks

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.activations + self.overhead

    def to_dict(self) -> dict:
        out = asdict(self.setting)
        out.update(weights=self.weights, gradients=self.gradients, optimizer_states=self.optimizer,
                   activations=self.activations, overhead=self.overhead, total=self.total,
                   relative_speed=round(self.relative_speed, 3), fits=self.fits)
        if self.peak_phase is not None:
            out["peak_phase"] = self.peak_phase
        return out


# What a plan asks of each setting: the peak of a training step (Planner.estimate, or another step's shape:
# rl_step.estimator). The setting's micro_batch x accumulation is the device's examples per step.
Estimator = Callable[[Setting], Estimate]


class Planner:
    """Estimates for one model, task, sequence length, device and process layout; the simulations
    (the costly part) are cached per (precision, checkpointing, micro-batch)."""

    def __init__(self, shapes: ModelShapes, seq_len: int, device: str = "cpu", world_size: int = 1,
                 strategy: str = "ddp", zero_stage: int = 2):
        self.shapes, self.seq_len, self.device = shapes, seq_len, device
        if tasks.get(shapes.task).is_text:
            loading.check_length(shapes.config, seq_len, "--seq-len")
        self.world_size, self.strategy, self.zero_stage = world_size, strategy, zero_stage
        # What the strategy shards across the processes (nothing with one process).
        self._fsdp = strategy == "fsdp" and world_size > 1
        self._zero = zero_stage if strategy == "deepspeed" and world_size > 1 else 0
        self._trainable_shapes = [s for s, t in shapes.param_shapes if t]
        self._phases: dict[tuple, simulate.Phases] = {}
        self._half_speedup: float | None = None

    def phases(self, precision: str, checkpointing: bool, micro_batch: int) -> simulate.Phases:
        key = (precision, checkpointing, micro_batch)
        if key not in self._phases:
            from torch._subclasses import fake_tensor

            try:
                rows = micro_batch * self.shapes.rows_per_example
                task = self.shapes.step_task or self.shapes.task
                self._phases[key] = simulate.micro_step(task, self.shapes.config, rows,
                                                        self.seq_len, precision, checkpointing, self.shapes.peft,
                                                        self.shapes.packing, self.shapes.loss_positions,
                                                        sharded=shards_weights(self.strategy))
            except (fake_tensor.DataDependentOutputException, fake_tensor.DynamicOutputShapeException,
                    fake_tensor.UnsupportedOperatorException) as err:
                raise UserError(f"{self.shapes.config.model_type} cannot be simulated on fake tensors: its forward "
                                f"depends on tensor values ({type(err).__name__})",
                                "choose --batch-size yourself (train without --memory-budget)")
        return self._phases[key]

    def _shard(self, nbytes: int, sharded: bool) -> int:
        return math.ceil(nbytes / self.world_size) if sharded else nbytes

    def model_states(self, optimizer: str) -> tuple[int, int, int]:
        """(weights, gradients, optimizer states) per device: arithmetic only, no simulation."""
        fsdp, zero = self._fsdp, self._zero
        weights = self._shard(self.shapes.weight_bytes, fsdp or zero >= 3) + self.shapes.buffer_bytes
        weights += self.shapes.reference_bytes  # a frozen copy is whole on every device, never sharded
        gradients = self.step_gradient_bytes()
        states = self._shard(optimizer_state_bytes(optimizer, self._trainable_shapes, self.shapes.block_matrices or ()),
                             fsdp or zero >= 1)
        if self.strategy == "ddp" and self.world_size > 1:
            gradients += 4 * self.shapes.trainable  # DDP's gradient buckets: a second copy, all-reduced
        return weights, gradients, states

    def step_gradient_bytes(self) -> int:
        """The gradients a step makes on this device (sharded where the strategy shards them), freed after its
        optimizer step; DDP's buckets, counted by `model_states` on top, stay."""
        return self._shard(4 * self.shapes.trainable, self._fsdp or self._zero >= 2)

    def estimate(self, setting: Setting) -> Estimate:
        fsdp, zero = self._fsdp, self._zero
        weights, gradients, states = self.model_states(setting.optimizer)
        phases = self.phases(setting.precision, setting.checkpointing, setting.micro_batch)
        layer = 4 * 2 * self.shapes.largest_layer_params  # a layer and the prefetched next one, full size
        if fsdp or zero >= 2:
            # Sharded gradients: a layer's full gradient lives only until it is reduce-scattered.
            # Accumulating under fsdp, the micro-batches before a step's last keep their gradients whole
            # (no reduce-scatter: sharding.no_sync), so the last one runs with all of them held.
            held = 4 * self.shapes.trainable if fsdp and setting.accumulation > 1 else gradients
            above = max(phases.forward_held, phases.first_held, phases.last_held) + held + layer
        else:
            # A later micro-batch of an accumulated step starts with every gradient held; DDP's
            # buckets are held throughout.
            full = 4 * self.shapes.trainable
            above = phases.peak(grads_before=full if setting.accumulation > 1 else 0) + gradients - full
        if fsdp or zero >= 3:
            above += layer  # the all-gathered weights of the current and the prefetched layer
        if fsdp:  # the root unit stays gathered from its forward to its backward (engine/sharding.shard)
            above += (2 if setting.precision == "bf16" else 4) * self.shapes.root_params
        # The optimizer step holds every gradient and the states, but no activations.
        step = gradients + optimizer_step_temporary_bytes(setting.optimizer, self._trainable_shapes)
        # What is left at the peak once weights, gradients and states are counted: activations and
        # the temporaries of the forward, loss and backward.
        activations = max(above, step) - gradients
        tensors = weights + gradients + states + activations
        overhead = self.overhead(phases, tensors)
        return Estimate(setting, weights, gradients, states, activations, overhead, self.relative_speed(setting))

    def overhead(self, phases: simulate.Phases, tensors: int) -> int:
        if self.device == "cpu":
            from effitrain.speedups import allocator

            preloaded = PRELOADED_OVERHEAD.get(allocator.serving()[0])
            if preloaded is not None:
                return preloaded
            return round(CPU_OVERHEAD["constant"] + CPU_OVERHEAD["churn_share"] * heap_churn(phases))
        return round(CUDA_OVERHEAD["context"] + CUDA_OVERHEAD["fragmentation"] * tensors)

    def relative_speed(self, setting: Setting) -> float:
        """Samples per second relative to fp32 + AdamW without checkpointing at the same micro-batch:
        operator FLOPs counted in the simulation (recomputation included), the precision's matmul
        speed-up, the optimizer's measured cost. Small-batch kernel efficiency is not modelled."""
        flops = self.phases(setting.precision, setting.checkpointing, setting.micro_batch).flops
        base = self.phases(setting.precision, False, setting.micro_batch).flops
        speed = base / flops if flops else 1.0
        if setting.precision != "fp32":  # Amdahl: only the matmul share of the time speeds up
            speed /= (1 - MATMUL_TIME_SHARE) + MATMUL_TIME_SHARE / self.half_speedup()
        return speed * optimizers.get(setting.optimizer).speed(self.device)

    def half_speedup(self) -> float:
        if self._half_speedup is None:
            if self.device == "cpu":
                from effitrain.runtime.devices import bf16_matmul_speedup

                self._half_speedup = bf16_matmul_speedup()
            else:
                self._half_speedup = GPU_HALF_SPEEDUP
        return self._half_speedup


def heap_churn(phases: simulate.Phases) -> int:
    """What a micro-step (forward and backward) allocates from glibc's heap: every piece when training keeps
    freed memory (on glibc, unless switched off: speedups/allocator.py), else the pieces under glibc's mmap
    threshold."""
    from effitrain.speedups import allocator

    small = phases.forward_heap_churn + phases.backward_heap_churn
    large = phases.forward_large_churn + phases.backward_large_churn
    return small + (large if allocator.keeps_freed_memory() else 0)


def micro_batches(batch: int) -> list[int]:
    """The micro-batches that split `batch` evenly, largest first, halving (16, 8, 4, 2, 1)."""
    sizes, size = [], batch
    while True:
        sizes.append(size)
        if size % 2 or size == 1:
            break
        size //= 2
    if sizes[-1] != 1:
        sizes.append(1)  # an odd batch: its only other even split is one example at a time
    return sizes


def recommend(estimates: list[Estimate]) -> Estimate | None:
    """The fastest that fits; among equals, the larger micro-batch (better kernel efficiency)."""
    fitting = [e for e in estimates if e.fits]
    return max(fitting, key=lambda e: (round(e.relative_speed, 2), e.setting.micro_batch), default=None)


def fit(planner: Planner, batch: int, precision: str, optimizer: str, checkpointing: bool,
        budget: int, accumulation: int = 1, techniques_fixed: bool = False,
        estimate_of: Estimator | None = None) -> tuple[Estimate, list[str]]:
    """What `train --memory-budget` applies: the user's settings when they fit; else trade micro-batch
    for accumulation (same effective batch), and only if even one example at a time does not fit,
    turn on checkpointing, then a lighter optimizer (not when `techniques_fixed`: a resumed run keeps
    what its checkpoint was trained with). Returns the choice and what changed, in words. `estimate_of`: the
    step's peak (default: planner.estimate)."""
    estimate_of = estimate_of or planner.estimate
    choices = [(checkpointing, optimizer)]
    if not techniques_fixed:
        can = (checkpointing, True) if planner.shapes.supports_checkpointing else (checkpointing,)
        lighter = accepted_optimizers(optimizers.get(optimizer).lighter, planner.strategy)
        choices += [(ckpt, optimizer) for ckpt in can[1:]] + [(ckpt, name) for name in lighter for ckpt in can]
    for ckpt, optim_name in choices:
        for micro in micro_batches(batch):
            estimate = estimate_of(Setting(precision, optim_name, ckpt, micro, batch // micro * accumulation))
            if estimate.total <= budget:
                estimate.fits = True
                changes = []
                if micro != batch:
                    changes.append(f"micro-batch {batch} -> {micro} with {batch // micro}x more accumulation")
                if ckpt != checkpointing:
                    changes.append("gradient checkpointing on")
                if optim_name != optimizer:
                    changes.append(f"optimizer {optimizer} -> {optim_name}")
                return estimate, changes
    ckpt, optim_name = choices[-1]  # the lightest choice tried
    smallest = estimate_of(Setting(precision, optim_name, ckpt, 1, batch * accumulation))
    raise UserError(f"nothing fits in {budget / GiB:.2f} GiB: even one example at a time with "
                    f"{smallest.setting.optimizer}" + (", gradient checkpointing" if smallest.setting.checkpointing
                                                      else "") + f" needs {smallest.total / GiB:.2f} GiB",
                    "raise --memory-budget, shorten --max-length, use more processes with --strategy fsdp, "
                    "or a smaller model")


def available_bytes(device: str) -> int:
    """Memory free for training now: CUDA free memory, or MemAvailable on Linux CPU."""
    if device == "cuda":
        free, _total = torch.cuda.mem_get_info()
        return int(free)
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    from effitrain.runtime.devices import total_memory_bytes

    return int((total_memory_bytes() or 8 * GiB) * 0.8)


def best_per_technique(planner: Planner, batch: int, precisions: list[str], optimizers: list[str],
                       checkpointing: list[bool], budget: int | None, every_micro_batch: bool = False,
                       estimate_of: Estimator | None = None) -> list[Estimate]:
    """One row per (precision, optimizer, checkpointing): the largest micro-batch that fits the budget
    (accumulation makes up the rest of `batch`), or the whole batch in one micro-batch when none fits
    or there is no budget. `every_micro_batch`: all of them instead. `estimate_of`: the step's peak
    (default: planner.estimate)."""
    estimate_of = estimate_of or planner.estimate
    rows = []
    for precision, optimizer, ckpt in itertools.product(precisions, optimizers, checkpointing):
        def at(micro: int) -> Estimate:
            estimate = estimate_of(Setting(precision, optimizer, ckpt, micro, batch // micro))
            estimate.fits = None if budget is None else estimate.total <= budget
            return estimate

        if every_micro_batch:
            rows += [at(micro) for micro in micro_batches(batch)]
            continue
        whole = at(batch)
        rows.append(whole)
        # The model's states alone over the budget: no micro-batch fits, nothing to simulate.
        if budget is None or whole.fits or sum(planner.model_states(optimizer)) > budget:
            continue
        smaller = micro_batches(batch)[1:]
        if not smaller or not at(smaller[-1]).fits:
            continue
        # Memory falls as the micro-batch does: bisect for the largest that fits (fewest simulations).
        low, high = 0, len(smaller) - 1  # smaller[high] fits
        while low < high:
            mid = (low + high) // 2
            if at(smaller[mid]).fits:
                high = mid
            else:
                low = mid + 1
        rows[-1] = at(smaller[high])
    return rows


def format_table(rows: list[Estimate], recommended: Estimate | None) -> str:
    def gib(n: int) -> str:
        return f"{n / GiB:.2f}"

    width = max([10, *(len(e.setting.optimizer) for e in rows)])  # the longest optimizer name
    phased = any(e.peak_phase for e in rows)  # a step of phases: the total is the larger, and which one says
    lines = [f"{'precision':9} {'optimizer':{width}} {'ckpt':4} {'micro x acc':>11} {'weights':>8} {'grads':>8} "
             f"{'optim':>8} {'activ':>8} {'overhd':>8} {'total':>8}" + (f" {'peak in':>10}" if phased else "")
             + f" {'speed':>6}  fits"]
    for e in rows:
        s = e.setting
        mark = {True: "yes", False: "no", None: "-"}[e.fits] + ("  <- recommended" if e is recommended else "")
        lines.append(f"{s.precision:9} {s.optimizer:{width}} {'on' if s.checkpointing else 'off':4} "
                     f"{f'{s.micro_batch} x {s.accumulation}':>11} {gib(e.weights):>8} {gib(e.gradients):>8} "
                     f"{gib(e.optimizer):>8} {gib(e.activations):>8} {gib(e.overhead):>8} {gib(e.total):>8} "
                     + (f"{e.peak_phase or '-':>10} " if phased else "") + f"{e.relative_speed:>5.2f}x  {mark}")
    return "\n".join(lines)
