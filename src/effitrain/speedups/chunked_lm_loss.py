"""A causal LM's output projection and cross-entropy, computed a chunk of positions at a time, over only
the positions whose target counts: the whole logits tensor ([tokens, vocabulary]) never exists.

At a 151,936-token vocabulary and 8 x 2,048 tokens the logits alone are 9.3 GiB in fp32, and a plain
`F.cross_entropy(model(...).logits.float(), ...)` holds them, their log-softmax and, in the backward,
their gradient. Here each chunk's logits are made in one buffer that every chunk reuses, turned in place
into the loss and the gradient of its rows (softmax - one-hot), and multiplied back into the hidden
states' and the weight's gradients, in the forward (as Liger-Kernel's fused linear cross-entropy does):
the same three matrix products as the plain path, no recomputation, and at most one chunk's logits alive. The backward only scales the
gradients kept by the incoming gradient (a scalar: the loss is a sum).

The arithmetic is the plain path's: logits in the matmul's dtype (bf16 under autocast, as the model's
head makes them), softmax and loss in fp32, the gradients' products in the matmul's dtype, the weight's
gradient summed over chunks in fp32. Tested equal to the plain path (tests/unit/test_chunked_lm_loss.py).
Plain PyTorch: it runs wherever torch does, forward and backward."""

from __future__ import annotations

import contextlib
import types

import torch
import torch.nn.functional as F

from effitrain.speedups.autocast_dtype import compute_dtype

CHUNK_BYTES = 64 * 2**20  # fp32 logits per chunk: the softmax and its gradient are about as large again


def chunk_rows(vocabulary: int) -> int:
    """Positions per chunk: CHUNK_BYTES of fp32 logits, at least 64 rows, so that the products stay
    large enough to run at full speed."""
    return max(64, CHUNK_BYTES // (4 * vocabulary))


class _ChunkBuffers:
    """The chunks' largest temporaries, allocated once per call and reused by every chunk (the last one a
    slice): the fp32 logits, which become their own gradient in place; in half precision the product's
    buffer and the weight gradient's. Fresh blocks of these sizes each chunk cost page faults and leave
    the C allocator holes of mixed sizes (benchmarks/results/memory_plan_*)."""

    def __init__(self, rows: int, weight: torch.Tensor, dtype: torch.dtype, weight_gradient: bool):
        self.fp32 = weight.new_empty((rows, weight.shape[0]), dtype=torch.float32)
        half = dtype != torch.float32
        self.low = weight.new_empty((rows, weight.shape[0]), dtype=dtype) if half else None
        self.weight_low = weight.new_empty(weight.shape, dtype=dtype) if half and weight_gradient else None

    def loss(self, rows, target, matrix, offset) -> torch.Tensor:
        """One chunk's summed loss, the logits' buffer overwritten."""
        return self._losses(self._logits(rows, matrix, offset), target)[0].sum()

    def losses_and_hits(self, rows, target, matrix, offset) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's loss, and whether its logits' arg-max is its target (evaluation's metrics)."""
        logits = self._logits(rows, matrix, offset)
        hits = logits.argmax(-1) == target
        return self._losses(logits, target)[0].squeeze(1), hits

    @staticmethod
    def _losses(logits, target) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's loss, logsumexp - the target's logit ([rows, 1]), and the softmax's denominators;
        logits becomes exp(logits - their row's max)."""
        picked = logits.gather(1, target[:, None])
        largest = logits.amax(1, keepdim=True)
        total = logits.sub_(largest).exp_().sum(1, keepdim=True)
        return total.log() + largest - picked, total

    def loss_and_gradients(self, rows, target, matrix, offset, grad_hidden, grad_weight, grad_bias) -> torch.Tensor:
        """One chunk's summed loss; its gradients written into grad_hidden (its rows) and added into
        grad_weight and grad_bias (fp32, or None where not wanted)."""
        logits = self._logits(rows, matrix, offset)
        # the loss, then d(sum of losses)/d(logits) = softmax - one-hot, in the logits' own buffer
        losses, total = self._losses(logits, target)
        gradient = logits.div_(total)
        gradient[torch.arange(len(target), device=target.device), target] -= 1
        if grad_bias is not None:
            grad_bias += gradient.sum(0)
        if self.low is not None:
            gradient = self.low[:gradient.shape[0]].copy_(gradient)
        if grad_hidden is not None:
            torch.mm(gradient, matrix, out=grad_hidden)
        if grad_weight is not None:  # the product in the compute dtype, summed in fp32
            if self.weight_low is None:
                grad_weight.addmm_(gradient.t(), rows)
            else:
                grad_weight += torch.mm(gradient.t(), rows, out=self.weight_low)
        return losses.sum()

    def _logits(self, rows, matrix, offset) -> torch.Tensor:
        """rows @ matrix^T + offset in the compute dtype (as F.linear makes it), as fp32."""
        n = rows.shape[0]
        product = self.fp32[:n] if self.low is None else self.low[:n]
        if offset is None:
            torch.mm(rows, matrix.t(), out=product)
        else:
            torch.addmm(offset, rows, matrix.t(), out=product)
        return product if self.low is None else self.fp32[:n].copy_(product)


class _LinearCrossEntropy(torch.autograd.Function):
    """sum over rows of cross_entropy(hidden @ weight^T + bias, targets); gradients made in the forward."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, dtype, rows_per_chunk, grad_enabled):
        # needs_input_grad says requires_grad even under no_grad: evaluation makes no gradients
        wants = [grad_enabled and needed for needed in ctx.needs_input_grad[:3]]
        matrix = weight.to(dtype)
        offset = None if bias is None else bias.to(dtype)
        loss = hidden.new_zeros((), dtype=torch.float32)
        grad_hidden = torch.empty_like(hidden, dtype=dtype) if wants[0] else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if wants[1] else None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if wants[2] else None
        with torch.autocast(hidden.device.type, enabled=False):
            chunks = [(start, min(start + rows_per_chunk, hidden.shape[0])) for start in range(0, hidden.shape[0],
                                                                                              rows_per_chunk)]
            buffers = _ChunkBuffers(min(rows_per_chunk, hidden.shape[0]), weight, dtype, grad_weight is not None)
            if not any(wants):  # evaluation: the loss alone
                for start, end in chunks:
                    loss += buffers.loss(hidden[start:end].to(dtype), targets[start:end], matrix, offset)
            else:
                for start, end in chunks:
                    loss += buffers.loss_and_gradients(hidden[start:end].to(dtype), targets[start:end], matrix, offset,
                                                       None if grad_hidden is None else grad_hidden[start:end],
                                                       grad_weight, grad_bias)
        ctx.save_for_backward(*(g for g in (grad_hidden, grad_weight, grad_bias) if g is not None))
        ctx.kept = [g is not None for g in (grad_hidden, grad_weight, grad_bias)]
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        kept = iter(ctx.saved_tensors)
        grads = [next(kept) * grad_loss if is_kept else None for is_kept in ctx.kept]
        grads = [None if g is None else g.to(dt) for g, dt in zip(grads, ctx.dtypes)]
        return (*grads, None, None, None, None)


def _planned_count(targets: torch.Tensor, per_row: int | None) -> int:
    """How many of a fake `targets`' positions the planner counts: the planner simulates a step on fake
    tensors, which have no labels to select by; each row has at most `per_row` positions with a loss
    (answer-only data: the longest answer of the training data), None: every position (text). The chunked
    head multiplies only those, as training does."""
    total = targets.numel()
    rows = total // max(targets.shape[-1], 1) if targets.dim() > 1 else 1
    return total if per_row is None else min(total, per_row * rows)


def loss_sum(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
             targets: torch.Tensor, ignore_index: int = -100, rows_per_chunk: int | None = None,
             planned_per_row: int | None = None) -> torch.Tensor:
    """The summed cross-entropy of `hidden @ weight^T + bias` against `targets` over the rows whose target
    is not `ignore_index`: those rows are dropped before the product. `hidden` is [..., H], `targets`
    the matching [...]. Returns an fp32 scalar, differentiable in hidden, weight and bias.
    `planned_per_row`: the planner's positions with a loss per row, for fake tensors (_planned_count)."""
    rows, wanted = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    if not _fake(targets):
        keep = wanted != ignore_index
        rows, wanted = rows[keep], wanted[keep]
    else:  # the planner's fake tensors have no values to select by: as many as it plans, gathered as the
        # mask gathers them (a copy of the rows)
        where = torch.arange(_planned_count(targets, planned_per_row), device=wanted.device)
        rows, wanted = rows[where], wanted[where]
    return _LinearCrossEntropy.apply(rows, weight, bias, wanted, compute_dtype(hidden),
                                     rows_per_chunk or chunk_rows(weight.shape[0]), torch.is_grad_enabled())


class _LinearTokenLogProbs(torch.autograd.Function):
    """Each row's log-probability of its target under log_softmax(hidden @ weight^T + bias), a chunk at a
    time. Unlike the summed loss, each row's incoming gradient differs (a preference loss weighs its
    sequences apart), so the backward makes each chunk's logits again: one more product than the summed
    loss, and still at most one chunk's logits alive."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, dtype, rows_per_chunk):
        out = hidden.new_empty(targets.shape, dtype=torch.float32)
        with torch.autocast(hidden.device.type, enabled=False):
            matrix, offset = weight.to(dtype), None if bias is None else bias.to(dtype)
            for start in range(0, hidden.shape[0], rows_per_chunk):
                logits = F.linear(hidden[start:start + rows_per_chunk].to(dtype), matrix, offset).float()
                target = targets[start:start + rows_per_chunk]
                out[start:start + rows_per_chunk] = -F.cross_entropy(logits, target, reduction="none")
        ctx.save_for_backward(hidden, weight, bias, targets)
        ctx.dtype, ctx.rows_per_chunk = dtype, rows_per_chunk
        return out

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, bias, targets = ctx.saved_tensors
        dtype, step = ctx.dtype, ctx.rows_per_chunk
        wants = ctx.needs_input_grad[:3]
        grad_hidden = torch.empty_like(hidden, dtype=dtype) if wants[0] else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if wants[1] else None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if bias is not None and wants[2] else None
        with torch.autocast(hidden.device.type, enabled=False):
            matrix, offset = weight.to(dtype), None if bias is None else bias.to(dtype)
            for start in range(0, hidden.shape[0], step):
                rows = hidden[start:start + step].to(dtype)
                target = targets[start:start + step]
                # d log p(target) / d logits = one-hot - softmax, times each row's incoming gradient
                gradient = -torch.softmax(F.linear(rows, matrix, offset).float(), dim=-1)
                gradient[torch.arange(len(target), device=target.device), target] += 1
                gradient *= grad_out[start:start + step, None].float()
                if grad_bias is not None:
                    grad_bias += gradient.sum(0)
                gradient = gradient.to(dtype)
                if grad_hidden is not None:
                    grad_hidden[start:start + step] = gradient @ matrix
                if grad_weight is not None:
                    grad_weight += (gradient.t() @ rows).float()
        grads = [None if g is None else g.to(t.dtype) for g, t in zip((grad_hidden, grad_weight, grad_bias),
                                                                      (hidden, weight, bias))]
        return (*grads, None, None, None)


def token_log_probs(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                    ignore_index: int = -100, rows_per_chunk: int | None = None,
                    planned_per_row: int | None = None) -> torch.Tensor:
    """Each position's log-probability of its target (0 where the target is `ignore_index`), shaped as
    `targets`, fp32, differentiable in hidden, weight and bias: a sequence's log-probability is its sum.
    Only the positions that count are multiplied (`planned_per_row`: as loss_sum's)."""
    flat, wanted = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    out = flat.new_zeros(wanted.shape, dtype=torch.float32)
    if _fake(targets):  # the planner's fake tensors: as many positions as it plans
        where = torch.arange(_planned_count(targets, planned_per_row), device=wanted.device)
    else:
        where = (wanted != ignore_index).nonzero().squeeze(1)
    picked = _LinearTokenLogProbs.apply(flat[where], weight, bias, wanted[where], compute_dtype(hidden),
                                        rows_per_chunk or chunk_rows(weight.shape[0]))
    return out.index_put((where,), picked).view(targets.shape)


@torch.no_grad()
def per_position(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                 ignore_index: int = -100) -> tuple[torch.Tensor, torch.Tensor]:
    """Evaluation's view, a chunk at a time: each position's loss (0 where ignored) and whether the
    arg-max of its logits is the target, both shaped as `targets`."""
    flat, wanted = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    losses = torch.zeros(wanted.shape, dtype=torch.float32, device=hidden.device)
    correct = torch.zeros(wanted.shape, dtype=torch.bool, device=hidden.device)
    keep = (wanted != ignore_index).nonzero().squeeze(1)
    dtype = compute_dtype(hidden)
    step = chunk_rows(weight.shape[0])
    buffers = _ChunkBuffers(min(step, len(keep)), weight, dtype, weight_gradient=False)
    matrix, offset = weight.to(dtype), None if bias is None else bias.to(dtype)
    with torch.autocast(hidden.device.type, enabled=False):
        for start in range(0, len(keep), step):
            where = keep[start:start + step]
            losses[where], correct[where] = buffers.losses_and_hits(flat[where].to(dtype), wanted[where], matrix, offset)
    return losses.view(targets.shape), correct.view(targets.shape)


# -- the model's side: an output layer that hands its input to the loss ---------------------------------
PASS_THROUGH = "effitrain_pass_through"


def apply(model: torch.nn.Module) -> bool:
    """Let the model's output layer return its input (the final hidden states) inside `hidden_states_of`,
    for this module's loss to multiply a chunk at a time. Returns whether it did: not for an output
    layer that is not a linear layer, nor for a model that changes the logits after it (Gemma's
    soft-capping, Cohere's logit scale...): those keep the plain loss. Checked with a 4-token forward
    both ways where the weights are real (not on the meta device, as the planner builds)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, torch.nn.Linear):
        return False
    pass_through(head)
    if head.weight.device.type != "meta" and not _fake(head.weight) and not _logits_are_the_heads(model, head):
        head.forward = head.effitrain_forward
        del head.effitrain_forward
        delattr(head, PASS_THROUGH)
        return False
    return True


def pass_through(layer: torch.nn.Module) -> None:
    """Let `layer` return its input inside `hidden_states_of`; the loss then multiplies by its `weight`
    (and `bias`, if it has one). `apply` does this to a linear output layer; models/adapters/trained_tokens.py
    to the wrapper peft's trainable tokens put around it."""
    layer.effitrain_forward = layer.forward  # the forward it has (oneDNN's, where that applies)
    setattr(layer, PASS_THROUGH, False)
    layer.forward = types.MethodType(_forward, layer)  # a bound method: deepcopy rebinds it


def prepared(layer: torch.nn.Module) -> bool:
    """Whether `apply` (or `pass_through`) prepared this layer."""
    return hasattr(layer, PASS_THROUGH)


def _forward(head, x: torch.Tensor) -> torch.Tensor:
    return x if getattr(head, PASS_THROUGH) else head.effitrain_forward(x)


def output_layer(model: torch.nn.Module) -> torch.nn.Linear | None:
    """The output layer `apply` prepared, inside whatever wraps the model (DDP, FSDP, peft, compile);
    None when it did not, or when an adapter wraps it (--lora-target-modules lm_head: the adapter's
    product is added to the logits). The outermost one prepared: peft's trainable-tokens wrapper, when
    models/adapters/trained_tokens.py prepared it, before the layer it wraps."""
    for name, module in model.named_modules():
        if hasattr(module, PASS_THROUGH):
            wrapped = name.rpartition(".")[2] == "base_layer"  # peft's tuner layers hold the layer they adapt there
            return None if wrapped else module
    return None


def weight_and_bias(head: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The output layer's weight and bias as the loss multiplies them, read after the model's forward
    (peft's trainable-tokens wrapper gives its effective weight: the base's rows with the trained ones).
    Under FSDP the root unit (which holds the output layer) stays gathered after its forward
    (engine/sharding.py: reshard_after_forward=False), so these are the gathered parameters, whose
    gradients FSDP reduce-scatters after the backward; one still sharded is gathered here, differentiably."""
    from torch.distributed.tensor import DTensor

    def whole(tensor):
        return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor

    bias = getattr(head, "bias", None)  # peft's trainable-tokens wrapper has none (nor does its product)
    return whole(head.weight), None if bias is None else whole(bias)


@contextlib.contextmanager
def hidden_states_of(head: torch.nn.Linear):
    """Inside: the model's forward returns the final hidden states where it would return logits."""
    setattr(head, PASS_THROUGH, True)
    try:
        yield
    finally:
        setattr(head, PASS_THROUGH, False)


def _fake(tensor: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(tensor)


@torch.no_grad()
def _logits_are_the_heads(model: torch.nn.Module, head: torch.nn.Linear) -> bool:
    ids = torch.arange(1, 5, device=head.weight.device).remainder(head.weight.shape[0]).unsqueeze(0)
    training = model.training
    model.eval()
    try:
        logits = model(input_ids=ids, use_cache=False).logits
        with hidden_states_of(head):
            hidden = model(input_ids=ids, use_cache=False).logits
    finally:
        model.train(training)
    return hidden.shape[-1] == head.in_features and torch.allclose(head(hidden), logits, rtol=1e-4, atol=1e-4)
