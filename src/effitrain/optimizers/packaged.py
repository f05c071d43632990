"""The optimizers that keep less state than AdamW beyond 8 bits, through their maintained packages:
GaLore and APOLLO (Adam's moments in a low-rank projection of each weight matrix), torch's Muon
(orthogonalised momentum for the blocks' matrices) and schedule-free AdamW (no decaying schedule).
What each stores is counted by state_sizes.py; catalogue.py names their builders."""

from __future__ import annotations

import torch

from effitrain.errors import UserError
from effitrain.optimizers.classic import adamw_of_groups
from effitrain.optimizers.state_sizes import LOW_RANK, projected

# GaLore's GLUE fine-tuning recipe (its README): projection renewed every 500 steps, scale 4.
GALORE = {"update_proj_gap": 500, "scale": 4.0, "proj_type": "std"}
# APOLLO's defaults (random projection renewed every 200 steps, channel-wise scaling); its fine-tuning
# recipe sets scale = the matrix's width / rank (LLaMA-8B: 4096 / 128 = 32).
APOLLO = {"update_proj_gap": 200, "proj": "random", "scale_type": "channel", "proj_type": "std"}


def _package(module: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:  # config validation checks first; this is for the Python API's direct callers
        raise UserError(f"the optimizer needs the {module} package, which is not installed",
                        "pip install 'effitrain[optimizers]'") from None


def _split(model: torch.nn.Module, weight_decay: float, chosen) -> tuple[list, list[dict]]:
    """(the parameters `chosen` picks, AdamW groups of the rest: no decay on 1-D tensors)."""
    picked, decay, no_decay = [], [], []
    for param in model.parameters():
        if param.requires_grad:
            (picked if chosen(param) else decay if param.ndim >= 2 else no_decay).append(param)
    rest = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return picked, [group for group in rest if group["params"]]


def galore(model: torch.nn.Module, lr: float, weight_decay: float, betas):
    galore_torch = _package("galore_torch")
    projector = _package("galore_torch.galore_projector").GaLoreProjector
    return _low_rank(model, lr, weight_decay, betas, galore_torch.GaLoreAdamW, projector,
                     lambda width: {"rank": LOW_RANK, **GALORE}, no_deprecation_warning=True)


def apollo(model: torch.nn.Module, lr: float, weight_decay: float, betas):
    apollo_torch = _package("apollo_torch")
    projector = _package("apollo_torch.random_projector").GradientProjector
    return _low_rank(model, lr, weight_decay, betas, apollo_torch.APOLLOAdamW, projector,
                     lambda width: {"rank": LOW_RANK, "scale": width / LOW_RANK, **APOLLO})


def _low_rank(model: torch.nn.Module, lr: float, weight_decay: float, betas, cls, projector, extra, **options):
    """GaLore or APOLLO: projected groups for the matrices wider than the rank, one per width (`extra`:
    a width's group settings; APOLLO's scale follows it), plain Adam moments for the rest."""
    matrices, rest = _split(model, weight_decay, lambda p: projected(tuple(p.shape)))
    by_width: dict[int, list] = {}
    for param in matrices:
        by_width.setdefault(min(param.shape), []).append(param)
    groups = [{"params": params, "weight_decay": weight_decay, **extra(width)} for width, params in by_width.items()]
    optimizer = cls(groups + rest, lr=lr, betas=betas, weight_decay=weight_decay, **options)
    keep_projectors(optimizer, projector)
    return optimizer


# A projector's settings, which its parameter group holds; the rest of its fields change as it runs.
PROJECTOR_SETTINGS = ("rank", "verbose", "update_proj_gap", "scale", "proj_type")


def keep_projectors(optimizer: torch.optim.Optimizer, projector_class) -> None:
    """GaLore and APOLLO keep each matrix's projection (and APOLLO its seed) in a Python object in the
    state. It is saved as its changing fields (tensors and numbers: what torch.load(weights_only=True)
    reads back, as accelerate loads checkpoints; torch's load_state_dict would mangle strings) and made
    again from its group's settings when loaded, so a resumed run projects as the uninterrupted one."""

    def as_fields(opt, state_dict):
        state = state_dict["state"]
        for key, values in state.items():
            if "projector" in values:  # a copy: these dicts are the optimizer's live state
                fields = {k: v for k, v in vars(values["projector"]).items() if k not in PROJECTOR_SETTINGS}
                state[key] = {**values, "projector": fields}
        return state_dict

    def as_objects(opt):
        for group in opt.param_groups:
            for param in group["params"]:
                values = opt.state.get(param, {})
                if isinstance(values.get("projector"), dict):
                    made = projector_class(group["rank"], update_proj_gap=group["update_proj_gap"],
                                           scale=group["scale"], proj_type=group["proj_type"])
                    made.__dict__.update(values["projector"])
                    values["projector"] = made

    optimizer.register_state_dict_post_hook(as_fields)
    optimizer.register_load_state_dict_post_hook(as_objects)


class MuonWithAdamW(torch.optim.Optimizer):
    """torch.optim.Muon for the 2-D weights inside the transformer blocks, fused AdamW for the rest
    (embeddings, head, 1-D tensors), as Muon's authors train; one optimizer, so that one schedule,
    one state dict and accelerate see all the groups. Muon's lr is matched to AdamW's update size
    (adjust_lr_fn="match_rms_adamw", Moonlight's rule), so --lr and --weight-decay serve both."""

    def __init__(self, matrices: list, rest: list[dict], lr: float, weight_decay: float, betas):
        self._muon = torch.optim.Muon(matrices, lr=lr, weight_decay=weight_decay, adjust_lr_fn="match_rms_adamw")
        # None where Muon takes every trained tensor (LoRA's matrices alone, say): torch refuses an empty AdamW
        self._adamw = adamw_of_groups(rest, lr, betas) if rest else None
        groups = [{**g, "muon": True} for g in self._muon.param_groups] + [
            {**g, "muon": False} for g in (self._adamw.param_groups if rest else [])]
        super().__init__(groups, {})

    @torch.no_grad()
    def step(self, closure=None):
        # The inner optimizers see this one's groups and state, which load_state_dict replaces.
        self._muon.param_groups = [g for g in self.param_groups if g["muon"]]
        self._muon.state = self.state
        if self._adamw is not None:
            self._adamw.param_groups = [g for g in self.param_groups if not g["muon"]]
            self._adamw.state = self.state
        loss = closure() if closure is not None else None
        self._muon.step()
        if self._adamw is not None and self._adamw.param_groups:
            self._adamw.step()
        return loss


def muon(model: torch.nn.Module, lr: float, weight_decay: float, betas, blocks: list) -> MuonWithAdamW:
    """`blocks`: the model's transformer blocks (models/blocks.py), whose 2-D weights Muon takes."""
    inside = {id(p) for block in blocks for p in block.parameters()}
    matrices, rest = _split(model, weight_decay, lambda p: p.ndim == 2 and id(p) in inside)
    if not matrices:
        raise UserError("--optim muon found no trainable 2-D weight inside the model's transformer blocks",
                        "use another --optim")
    return MuonWithAdamW(matrices, rest, lr, weight_decay, betas)


def schedule_free(model: torch.nn.Module, lr: float, weight_decay: float, betas):
    """Schedule-free AdamW; the warm-up comes from effitrain's schedule (schedule.py), constant after."""
    _, groups = _split(model, weight_decay, lambda p: False)
    optimizer = _package("schedulefree").AdamWScheduleFree(groups, lr=lr, betas=betas, warmup_steps=0)
    optimizer.train()  # training starts at the point y; a resumed run's checkpoint says train mode too
    return optimizer
