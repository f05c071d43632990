"""speedups/first_token_head.py: a sequence classifier whose last layer computes only the first token's row gives
the logits, the loss and the gradients of the whole model, and is applied only where that holds."""

import copy

import pytest
import torch
from effitrain.speedups import dropout, first_token_head
from test_packing import features, tiny_model


def padded_batch(tokenizer, pairs: bool = False) -> dict:
    from effitrain.data import text

    batch = text.collator(tokenizer)(features(tokenizer, pairs))
    assert (batch["attention_mask"] == 0).any()  # padding in the batch: the mask's rows matter
    return batch


def loss_and_grads(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor, dict]:
    model.zero_grad()
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    logits = model(**inputs).logits
    loss = torch.nn.functional.cross_entropy(logits, batch["labels"])
    loss.backward()
    return logits.detach(), loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                            if p.grad is not None}


@pytest.mark.parametrize("model_type", sorted(first_token_head.ENCODERS))
@pytest.mark.parametrize("attention", ["sdpa", "eager", dropout.ATTENTION])
def test_logits_loss_and_gradients_equal_the_whole_model(tokenizer, model_type, attention):
    dropout.register()
    whole = tiny_model(model_type, tokenizer, attention).train()  # dropout off in the tiny config
    pruned = copy.deepcopy(whole)
    assert first_token_head.apply(pruned)
    batch = padded_batch(tokenizer, pairs=model_type in ("bert", "electra"))
    logits, loss, grads = loss_and_grads(whole, batch)
    logits_pruned, loss_pruned, grads_pruned = loss_and_grads(pruned, batch)
    torch.testing.assert_close(logits_pruned, logits, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss_pruned, loss, rtol=1e-5, atol=1e-6)
    assert grads_pruned.keys() == grads.keys()  # every weight of the last layer still learns
    for name, grad in grads.items():
        torch.testing.assert_close(grads_pruned[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    with torch.no_grad():  # evaluation too
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        torch.testing.assert_close(pruned.eval()(**inputs).logits, whole.eval()(**inputs).logits,
                                   rtol=1e-5, atol=1e-6)


def test_gradient_checkpointing_and_a_batch_without_padding(tokenizer):
    """Checkpointing recomputes the pruned layer; a batch with no padding gets no mask at all (SDPA)."""
    whole = tiny_model("bert", tokenizer).train()
    pruned = copy.deepcopy(whole)
    first_token_head.apply(pruned)
    pruned.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    batch = padded_batch(tokenizer)
    batch = {k: v[:, :3] if v.dim() == 2 else v for k, v in batch.items()}  # 3 tokens: no padding left
    assert (batch["attention_mask"] == 1).all()
    _, loss, grads = loss_and_grads(whole, batch)
    _, loss_pruned, grads_pruned = loss_and_grads(pruned, batch)
    torch.testing.assert_close(loss_pruned, loss, rtol=1e-5, atol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grads_pruned[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_a_copy_runs_its_own_layer(tokenizer):
    """The forward is bound to its layer: a deep copy (the planner's, a user's) computes with its own
    weights, not the original's."""
    model = tiny_model("bert", tokenizer).eval()
    first_token_head.apply(model)
    copied = copy.deepcopy(model)
    last = copied.bert.encoder.layer[-1]
    assert last.forward.__self__ is last
    with torch.no_grad():
        last.output.LayerNorm.bias.add_(1.0)  # the first row's output, as the pooler reads it
    batch = padded_batch(tokenizer)
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        assert not torch.allclose(copied(**inputs).logits, model(**inputs).logits)


def test_left_alone_where_it_would_not_hold(tokenizer):
    from transformers import AutoConfig, AutoModel

    assert not first_token_head.apply(tiny_model("distilbert", tokenizer))  # another layer structure
    decoder = tiny_model("bert", tokenizer)
    decoder.config.is_decoder = True
    assert not first_token_head.apply(decoder)  # causal attention: the first token sees only itself
    assert not first_token_head.apply(tiny_model("bert", tokenizer, attention="flex_attention"))
    config = AutoConfig.for_model("bert", hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=64)
    assert not first_token_head.apply(AutoModel.from_config(config))  # no head: every row is the output


def test_a_training_run_prunes_unless_packing(tiny_model_dir, tmp_path):
    """Through the engine: the classifier of a run computes its last layer for the first token only, and
    a packed run (whose head reads each example's first token) is left whole."""
    import effitrain

    built = []

    class Recorder:  # the model a run trains, as set-up built it
        def on_train_begin(self, job):
            built.append(job.accelerator.unwrap_model(job.model))

    rows = "\n".join(f"\"message number {i} {'win a prize' if i % 3 == 0 else 'see you'}\","
                     f"{['ham', 'spam'][i % 3 == 0]}" for i in range(40))
    (tmp_path / "d.csv").write_text("text,label\n" + rows + "\n")
    for packing in (False, True):
        metrics = effitrain.train({"model": str(tiny_model_dir), "data": str(tmp_path / "d.csv"), "max_steps": 2,
                                   "batch_size": 8, "max_length": 24, "packing": packing,
                                   "output_dir": str(tmp_path / f"run-{packing}")}, callbacks=[Recorder()])
        assert ("first-token-head" in metrics["transforms"]) == (not packing)
    plain, packed = built
    assert "forward" in vars(plain.base_model.encoder.layer[-1])
    assert "forward" not in vars(packed.base_model.encoder.layer[-1])
