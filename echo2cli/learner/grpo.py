"""GRPO advantages and the clipped, importance-corrected policy loss. Pure torch, no I/O.

Advantages (Shao et al. 2024, DeepSeekMath): for a group of G samples of one prompt with rewards r,
    A_i = (r_i - mean(r)) / (std(r) + eps)          # population std; a group with equal rewards has A = 0

Loss, per completion token, against the *behaviour* policy mu that generated the token on a worker:
    w   = pi_theta(a|s) / mu(a|s)                    # one importance weight covers both staleness
                                                     # (mu is up to S versions old) and the mismatch
                                                     # between the vLLM engine and the trainer
    obj = min(w A, clip(w, 1 - eps, 1 + eps) A)      # PPO clipping (Schulman et al. 2017)
    obj = max(obj, C A)  where A < 0                 # dual clip (Ye et al. 2020): truncates the
                                                     # weight at C, so a token that became much more
                                                     # likely since it was sampled cannot blow up
    loss = -sum(obj * mask) / sum(mask)  (+ kl_coef * k3(pi_theta, pi_ref))
Token-level averaging (DAPO, Yu et al. 2025) weighs long and short completions by their tokens.

The learner takes one optimizer step per batch, so this is the only correction needed between the
policy that sampled and the one being updated.
"""

from __future__ import annotations

import torch


def compute_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """rewards: [num_groups, G] → advantages of the same shape."""
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, keepdim=True, correction=0)
    return (rewards - mean) / (std + eps)


def grpo_loss(
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_eps: float = 0.2,
    is_cap: float = 3.0,
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """logp, behaviour_logp, mask, ref_logp: [N, T]; advantages: [N]. Returns (loss, metrics)."""
    mask = mask.to(logp.dtype)
    n_tokens = mask.sum().clamp(min=1.0)
    log_w = logp - behaviour_logp
    w = torch.exp(log_w)
    adv = advantages[:, None].to(logp.dtype)
    unclipped = w * adv
    obj = torch.minimum(unclipped, torch.clamp(w, 1 - clip_eps, 1 + clip_eps) * adv)
    truncated = (adv < 0) & (obj < is_cap * adv)
    obj = torch.where(truncated, is_cap * adv, obj)
    per_token = -obj
    kl = torch.zeros((), dtype=logp.dtype)
    if ref_logp is not None and kl_coef > 0:
        d = ref_logp - logp
        k3 = torch.exp(d) - d - 1  # Schulman's unbiased, non-negative KL estimator
        per_token = per_token + kl_coef * k3
        kl = (k3 * mask).sum() / n_tokens
    loss = (per_token * mask).sum() / n_tokens

    def masked_mean(x: torch.Tensor) -> float:
        return float((x.to(logp.dtype) * mask).sum() / n_tokens)

    with torch.no_grad():
        metrics = {
            "train/loss": float(loss),
            "train/clipfrac": masked_mean(obj.detach() != unclipped.detach()),
            "train/is_weight_mean": masked_mean(w.detach()),
            "train/is_weight_max": float(torch.where(mask > 0, w.detach(), 0).max()),
            "train/is_truncated_frac": masked_mean(truncated),
            "train/kl_behaviour": masked_mean(torch.exp(-log_w.detach()) + log_w.detach() - 1),
            "train/kl_ref": float(kl),
        }
    return loss, metrics


def worst_tokens(logp: torch.Tensor, behaviour_logp: torch.Tensor, mask: torch.Tensor, k: int = 3) -> list[tuple]:
    """The k completion tokens where trainer and behaviour log-probs differ most, most first.

    Returns (row, position, log_w) with log_w = logp - behaviour_logp; position counts completion tokens from 0.
    A token the trainer finds far less likely than the engine said (log_w << 0) is what makes
    `train/kl_behaviour` (mean of exp(-log_w) + log_w - 1) spike: one token at log_w = -10 adds 22,000 to the
    sum. Same-version noise measured 0.36 nats at most (docs/BENCHMARKS.md), so anything past a few nats is
    staleness or a real disagreement worth a look.
    """
    logp = logp.detach()
    gap = torch.where(mask > 0, (logp - behaviour_logp).abs(), -1.0)
    top = torch.topk(gap.flatten(), min(k, gap.numel()))
    first = mask.to(torch.long).argmax(dim=1)  # each row's first completion position
    out = []
    for value, flat in zip(top.values.tolist(), top.indices.tolist(), strict=True):
        if value < 0:
            break
        row, col = divmod(flat, gap.shape[1])
        out.append((row, col - int(first[row]), float(logp[row, col] - behaviour_logp[row, col])))
    return out
