"""Length grouping's training order and the linear schedule: transformers' own, written out."""

import pytest


@pytest.mark.parametrize("count,batch", [(3888, 16), (3888, 64), (100, 16), (7, 16), (1, 1), (500, 3)])
def test_length_grouped_order_is_transformers(count, batch):
    """effitrain's LengthGroupedSampler (data/text.py, written out to spare a run transformers' Trainer
    imports) gives transformers' order index for index, epoch after epoch, ties and tiny sets included."""
    import torch
    from effitrain.data.text import LengthGroupedSampler
    from transformers.trainer_pt_utils import LengthGroupedSampler as Transformers

    sizes = torch.randint(1, 40, (count,), generator=torch.Generator().manual_seed(count)).tolist()
    ours = LengthGroupedSampler(batch, sizes, torch.Generator().manual_seed(42))
    theirs = Transformers(batch, lengths=sizes, generator=torch.Generator().manual_seed(42))
    for _ in range(3):  # the same generator drawn on: each epoch's order
        assert list(ours) == list(theirs)
    assert len(ours) == len(theirs) == count


@pytest.mark.parametrize("shape", ["linear", "cosine", "constant"])
@pytest.mark.parametrize("warmup,total,processes", [(6, 60, 1), (0, 10, 1), (3, 7, 2), (10, 10, 1), (2, 100, 4)])
def test_the_schedules_are_transformers(warmup, total, processes, shape):
    """optimizers/schedule.linear_schedule (written out for the same reason) gives transformers' learning rates
    step for step for --lr-schedule linear, cosine and constant (after its warm-up), and saves the same
    scheduler state."""
    import torch
    from effitrain.optimizers import schedule
    from transformers import (get_constant_schedule_with_warmup, get_cosine_schedule_with_warmup,
                              get_linear_schedule_with_warmup)

    theirs_of = {"linear": lambda o: get_linear_schedule_with_warmup(o, warmup * processes, total * processes),
                 "cosine": lambda o: get_cosine_schedule_with_warmup(o, warmup * processes, total * processes),
                 "constant": lambda o: get_constant_schedule_with_warmup(o, warmup * processes)}

    def rates(make) -> tuple[list[float], dict]:
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
        scheduler = make(optimizer)
        seen = []
        for _ in range((total + 3) * processes):
            seen.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            scheduler.step()
        return seen, scheduler.state_dict()

    ours, our_state = rates(lambda o: schedule.linear_schedule(o, total, warmup, processes, shape=shape))
    theirs, their_state = rates(theirs_of[shape])
    assert ours == pytest.approx(theirs, rel=1e-12, abs=1e-18)
    assert our_state.keys() == their_state.keys() and our_state["last_epoch"] == their_state["last_epoch"]
