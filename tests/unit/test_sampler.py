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


@pytest.mark.parametrize("warmup,total,processes", [(6, 60, 1), (0, 10, 1), (3, 7, 2), (10, 10, 1), (2, 100, 4)])
def test_linear_schedule_is_transformers(warmup, total, processes):
    """optimizers/schedule.linear_schedule (written out for the same reason) gives transformers' learning rates
    step for step, and saves the same scheduler state."""
    import torch
    from effitrain.optimizers import schedule
    from transformers import get_linear_schedule_with_warmup

    def rates(make) -> tuple[list[float], dict]:
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
        scheduler = make(optimizer)
        seen = []
        for _ in range((total + 3) * processes):
            seen.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            scheduler.step()
        return seen, scheduler.state_dict()

    ours, our_state = rates(lambda o: schedule.linear_schedule(o, total, warmup, processes))
    theirs, their_state = rates(lambda o: get_linear_schedule_with_warmup(o, warmup * processes, total * processes))
    assert ours == theirs
    assert our_state == their_state
