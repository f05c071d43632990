"""The policy-gradient arithmetic of GRPO (with DAPO's and Dr. GRPO's losses) and RLOO, as TRL 1.16 defines it
(trl/trainer/grpo_trainer.py: the advantages of `_generate_and_score_completions` and `_compute_loss`;
trl/trainer/rloo_trainer.py for RLOO), as pure functions on tensors; no model, no process group.

How an objective uses it, once per optimizer step:
1. rewards [prompts, G], weighted and summed over the reward functions, GATHERED OVER ALL PROCESSES first
   (a group may straddle processes; TRL gathers too), then `advantages(rewards, scale_rewards, rloo)`, the same
   tensor on every process whatever the layout; each process keeps its sequences' rows;
2. on each micro-batch: `token_loss` (GRPO family) or `sequence_loss` (RLOO) on the completion tokens'
   log-probs, then `loss_sum(...)` as the objective's loss and `item_count(...)` as its items: the step runner
   (engine/step.py) divides the sum over every micro-batch of every process by the count over all of them.

Step-global normalisation, and where it differs from TRL (TRL scales each micro-batch's loss itself; the
step runner divides sums by step-wide counts instead, so any split of the step into processes x micro-batches
x pieces gives the same loss and gradient):
- dapo: the completion tokens' loss summed, over the step's completion tokens. TRL's dapo is the same (it
  divides by the generation batch's tokens, gathered over processes).
- grpo: each sequence's mean over its tokens, then the mean over the step's sequences. TRL takes the mean over
  a micro-batch's sequences, then divides by the accumulation steps and DDP averages over processes: the same
  when every micro-batch holds as many sequences (TRL's layout), a mean of unequal means otherwise.
- dr_grpo: the token sum over (the step's sequences x max_new_tokens). TRL divides by each micro-batch's
  sequences x max_completion_length, then as grpo: the same with equal micro-batches.
- bnpo: TRL divides by each micro-batch's tokens (it says itself that this depends on the layout); over the
  whole step that is dapo's division, so the step-global bnpo here IS dapo.
- rloo (TRL's RLOOTrainer): a ratio per sequence (its tokens' log-probs summed), clipped, the mean over the
  step's sequences (TRL: over a micro-batch's, then the Trainer's division by the accumulation steps).
Groups whose rewards are all equal get an advantage of exactly 0 here (TRL leaves the rounding residue of
`r - mean`, up to ~1e-12 after division by std + 1e-4), so they move nothing."""

from __future__ import annotations

import torch

from effitrain.errors import UserError

SCALE_REWARDS = ("group", "batch", "none")
LOSS_TYPES = ("dapo", "grpo", "dr_grpo", "bnpo", "rloo")  # rloo: the per-sequence loss of `sequence_loss`
STD_EPSILON = 1e-4  # TRL's: added to the std before dividing, so a zero-spread group gives 0, not NaN
TOKEN_METRICS = ("clip_ratio_low", "clip_ratio_high", "clip_ratio_region", "kl")  # sums over tokens, then "tokens"
SEQUENCE_METRICS = ("clip_ratio_low", "clip_ratio_high", "clip_ratio_region")  # sums over sequences, "sequences"


def nanstd(values: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """The standard deviation of the non-NaN values, with Bessel's correction (n - 1), NaN for fewer than two
    values: TRL's `nanstd` (a reward function may return None, which the rewards hold as NaN)."""
    mean = torch.nanmean(values, dim=dim, keepdim=True)
    variance = torch.nanmean((values - mean) ** 2, dim=dim, keepdim=True)
    # In the values' dtype: TRL's count / (count - 1) is float32 whatever the values (fp64 differs by ~1e-8)
    count = (~torch.isnan(values)).sum(dim=dim, keepdim=True).to(values.dtype)
    variance = variance * torch.where(count > 1, count / (count - 1), torch.full_like(variance, float("nan")))
    std = variance.sqrt()
    return std.squeeze() if dim is None else std.squeeze(dim)


def zero_spread(rewards: torch.Tensor) -> torch.Tensor:
    """[prompts] True for groups whose scorable (non-NaN) rewards are all equal, or fewer than two: no signal."""
    scorable = ~torch.isnan(rewards)
    high = torch.where(scorable, rewards, -torch.inf).amax(dim=1)
    low = torch.where(scorable, rewards, torch.inf).amin(dim=1)
    return (scorable.sum(dim=1) < 2) | (high == low)


def zero_spread_share(rewards: torch.Tensor) -> float:
    """The share of the step's groups with no reward spread (the `zero_spread_share` metric; TRL's
    frac_reward_zero_std with scale_rewards "group"). Computed on the gathered rewards: a step-wide share."""
    return float(zero_spread(rewards).double().mean()) if len(rewards) else 0.0


def advantages(rewards: torch.Tensor, scale_rewards: str = "group", rloo: bool = False) -> torch.Tensor:
    """[prompts, G] advantages from the step's rewards [prompts, G] (every process's, gathered; NaN where no
    reward function scored a completion: advantage 0, left out of the baselines, as TRL does).
    GRPO (rloo False): reward minus its group's mean; scale_rewards "group" divides by the group's std + 1e-4,
    "batch" by the std of all the step's rewards + 1e-4, "none" by nothing (Dr. GRPO).
    RLOO (rloo True, TRL's RLOOTrainer): reward minus the mean of the group's other rewards; "none" (TRL's
    default) as is, "batch" (TRL's normalize_advantages) minus the step's mean advantage, over its std + 1e-4.
    Zero-spread groups get exactly 0."""
    if scale_rewards not in SCALE_REWARDS:
        raise UserError(f"scale_rewards {scale_rewards!r} is not one of {', '.join(SCALE_REWARDS)}",
                        "use group (GRPO's default), batch, or none (Dr. GRPO)")
    if rloo and scale_rewards == "group":
        raise UserError("RLOO does not scale its advantages by each group's spread (TRL's RLOO has no such option)",
                        "set scale_rewards to none (TRL's RLOO default) or batch (its normalize_advantages)")
    values = _rloo_advantages(rewards, scale_rewards) if rloo else _group_advantages(rewards, scale_rewards)
    values = torch.nan_to_num(values, nan=0.0)
    return torch.where(zero_spread(rewards)[:, None], torch.zeros_like(values), values)


def _group_advantages(rewards: torch.Tensor, scale_rewards: str) -> torch.Tensor:
    centred = rewards - torch.nanmean(rewards, dim=1, keepdim=True)
    if scale_rewards == "none":
        return centred
    if scale_rewards == "group":
        std = nanstd(rewards, dim=1)[:, None] if rewards.shape[1] > 1 else torch.zeros_like(rewards)
    else:
        std = nanstd(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    return centred / (std + STD_EPSILON)


def _rloo_advantages(rewards: torch.Tensor, scale_rewards: str) -> torch.Tensor:
    if rewards.shape[1] < 2:
        return torch.zeros_like(rewards)
    scorable = (~torch.isnan(rewards)).sum(dim=1, keepdim=True)
    baseline = (torch.nansum(rewards, dim=1, keepdim=True) - rewards) / (scorable - 1)  # the others' mean
    values = rewards - baseline
    if scale_rewards == "batch":
        values = (values - torch.nanmean(values)) / (nanstd(values) + STD_EPSILON)
    return values


def contributing(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[sequences] bool: the completions whose loss term and its gradient are not exactly zero with one update
    per generation (ratio 1) and no KL term in the loss: a non-zero advantage (a group with no spread has none)
    and a token that counts (mask: --mask-truncated zeroes a completion's). The others' loss is -min(1 x 0,
    clip(1) x 0) or masked: leaving them out of the forward changes neither the loss nor the gradient."""
    return (advantages.flatten() != 0) & mask.bool().any(dim=-1)


def kl_k3(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """Per token, Schulman's k3 estimate of KL(policy || reference) on the policy's samples:
    exp(ref - logp) - (ref - logp) - 1, >= 0 (TRL's GRPO)."""
    delta = ref_logps - logps
    return torch.exp(delta) - delta - 1


def token_loss(logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
               epsilon_low: float = 0.2, epsilon_high: float | None = None, ref_logps: torch.Tensor | None = None,
               beta: float = 0.0, kl_bias_correction: bool = True) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO's per-token loss [sequences, tokens], unmasked (loss_sum masks it), and its metrics' sums.
    logps: the completion tokens' log-probs under the policy (with grad); old_logps: under the policy that
    generated them (with one update per generation, logps.detach(): ratio 1, the REINFORCE gradient);
    advantages: [sequences] or [sequences, 1]; mask: the completion tokens that count.
    Loss: -min(ratio x A, clip(ratio, 1 - epsilon_low, 1 + epsilon_high) x A) (epsilon_high > epsilon_low:
    DAPO's clip-higher; None: epsilon_low), plus beta x k3 KL to ref_logps, multiplied by the ratio when
    kl_bias_correction (TRL 1.16's default use_bias_correction_kl: it changes the gradient even at ratio 1).
    Metrics: TOKEN_METRICS summed over the masked tokens ("kl" only with ref_logps), and "tokens", their
    count: summed over micro-batches and processes and divided, they are TRL's step-wide clip_ratio/*_mean."""
    epsilon_high = epsilon_low if epsilon_high is None else epsilon_high
    advantages = advantages[:, None] if advantages.dim() == 1 else advantages
    ratio = torch.exp(logps - old_logps)
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    loss = -torch.min(ratio * advantages, clipped * advantages)
    weights = mask.to(logps.dtype)
    low, high = (ratio < 1 - epsilon_low) & (advantages < 0), (ratio > 1 + epsilon_high) & (advantages > 0)
    metrics = {"clip_ratio_low": _masked_sum(low, weights), "clip_ratio_high": _masked_sum(high, weights),
               "clip_ratio_region": _masked_sum(low | high, weights)}
    if ref_logps is not None:
        kl = kl_k3(logps, ref_logps) * (ratio if kl_bias_correction else 1.0)
        metrics["kl"] = _masked_sum(kl, weights)
        if beta != 0.0:
            loss = loss + beta * kl
    metrics["tokens"] = weights.detach().double().sum()
    return loss, metrics


def sequence_loss(logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                  epsilon_low: float = 0.2, epsilon_high: float | None = None
                  ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """RLOO's per-sequence loss [sequences] (TRL's RLOOTrainer): the ratio of each completion's probability,
    exp(sum of masked logps - sum of masked old_logps), clipped as in token_loss; `old_logps` per token like
    `logps`. Its KL to a reference is a reward penalty, not a loss term (`sequence_kl`). Metrics: SEQUENCE_METRICS
    summed over sequences, and "sequences"."""
    epsilon_high = epsilon_low if epsilon_high is None else epsilon_high
    advantages = advantages.flatten()
    weights = mask.to(logps.dtype)
    ratio = torch.exp((logps * weights).sum(-1) - (old_logps * weights).sum(-1))
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    loss = -torch.min(ratio * advantages, clipped * advantages)
    low, high = (ratio < 1 - epsilon_low) & (advantages < 0), (ratio > 1 + epsilon_high) & (advantages > 0)
    metrics = {"clip_ratio_low": low.double().sum(), "clip_ratio_high": high.double().sum(),
               "clip_ratio_region": (low | high).double().sum(),
               "sequences": torch.tensor(float(len(low)), dtype=torch.float64, device=low.device)}
    return loss, metrics


def sequence_kl(old_logps: torch.Tensor, ref_logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[sequences] RLOO's KL penalty (TRL's RLOOTrainer: the first-order log ratio of the generating policy to
    the reference, summed over the completion): rewards - beta x this, gathered like the rewards, before
    `advantages`. Its sum over the step's tokens / their count is TRL's RLOO "kl" metric."""
    return ((old_logps - ref_logps) * mask.to(old_logps.dtype)).sum(-1)


def mask_truncated(mask: torch.Tensor, truncated: torch.Tensor) -> torch.Tensor:
    """The completion mask with the truncated completions' rows zeroed (TRL's mask_truncated_completions: a
    completion cut at max_new_tokens, not ended by end-of-turn/EOS, is neither rewarded nor penalised).
    Their sequences still count in grpo's and dr_grpo's sequence counts, as in TRL."""
    return mask * (~truncated.bool())[:, None].to(mask.dtype)


def _loss_type(loss_type: str) -> str:
    name = loss_type.replace("-", "_")  # the CLI's dr-grpo is TRL's dr_grpo
    if name not in LOSS_TYPES:
        raise UserError(f"loss type {loss_type!r} is not one of {', '.join(LOSS_TYPES)}",
                        "use dapo (the default), grpo or dr-grpo")
    return name


def loss_sum(loss: torch.Tensor, mask: torch.Tensor, loss_type: str) -> torch.Tensor:
    """A micro-batch's loss as a sum over its items (the objective's `loss`): `loss` is token_loss's
    [sequences, tokens], or sequence_loss's [sequences] for "rloo"."""
    name = _loss_type(loss_type)
    if name == "rloo":
        return loss.sum()
    masked = loss * mask.to(loss.dtype)
    if name == "grpo":  # each sequence's mean over its tokens; a fully masked one adds 0 but still counts
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1).to(loss.dtype)).sum()
    return masked.sum()


def item_count(mask: torch.Tensor, loss_type: str, max_new_tokens: int) -> torch.Tensor:
    """The items loss_sum sums over, known before the forward (the objective's `item_count`), additive over
    any split of the sequences: dapo/bnpo the completion tokens, grpo/rloo the sequences, dr_grpo the
    sequences x max_new_tokens."""
    name = _loss_type(loss_type)
    if name in ("dapo", "bnpo"):
        return mask.sum()
    sequences = torch.tensor(mask.shape[0], device=mask.device)
    return sequences * max_new_tokens if name == "dr_grpo" else sequences


def loss_sum_and_count(loss: torch.Tensor, mask: torch.Tensor, loss_type: str,
                       max_new_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss_sum, item_count): over a whole step, sum / count is TRL's loss of that loss type."""
    return loss_sum(loss, mask, loss_type), item_count(mask, loss_type, max_new_tokens)


def _masked_sum(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return (values.detach().double() * weights.detach().double()).sum()
