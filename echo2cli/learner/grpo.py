"""GRPO advantages and the policy loss with its off-policy correction. Pure torch, no I/O.

Advantages (Shao et al. 2024, DeepSeekMath): for a group of G samples of one prompt with rewards r,
    A_i = (r_i - mean(r)) / (std(r) + eps)          # population std; a group with equal rewards has A = 0

Each completion token was sampled by a *behaviour* policy mu: a worker's vLLM engine running a version up to
S steps old, and
    w = pi_theta(a|s) / mu(a|s)                      # one ratio covers staleness and engine-vs-trainer mismatch
is the off-policy ratio. sg() below stops the gradient. r = pi_theta / pi_prox is PPO's ratio to the proximal
("old") policy, the one before the batch's first optimizer step: with one step per batch (`--minibatches 1`,
the default) pi_prox = sg(pi_theta), so r is 1 with gradient grad log pi_theta and its clip never acts. With
several mini-batches, one optimizer step each (AReaL's ppo_n_minibatches), pi_prox is scored before the first
and r leaves 1 in the later ones; its clip is then the trust region of the corrections built on r, and their
behaviour weights (sg(w), rho, rho_geo below) are taken with pi_prox in place of pi_theta. `off_policy` picks
how w corrects the objective, per token:

- token_tis (default): PPO clip on w (Schulman et al. 2017) and dual clip (Ye et al. 2020), which truncates
  the weight at C for negative advantages:
      obj = max(min(w A, clip(w, 1-eps, 1+eps) A), C A)  where A < 0, else min(w A, clip(w, 1-eps, 1+eps) A)
- seq_mask: sequence-level importance weight, dropped when too large (TRL GRPOTrainer,
  vllm_importance_sampling_mode="sequence_mask", clip_max 3.0):
      rho = exp(sum_t log w_t);  obj = sg(rho) * min(r A, clip(r) A),  0 for the whole sequence if rho > C
- geo_mask: geometric-mean sequence rejection (SkyRL `geo_mask`, bounds 0.99 / 1.01; verl's geometric
  rollout rejection sampling): no weight, a sequence is dropped unless its per-token mean ratio is near 1:
      rho_geo = exp(mean_t log w_t);  obj = min(r A, clip(r) A) if geo_low <= rho_geo <= geo_high, else 0
- decoupled: AReaL's decoupled PPO (Fu et al. 2025, arXiv 2505.24298): the behaviour weight pi_prox / mu
  scales a PPO term clipped around pi_prox, and a token whose weight exceeds C is masked (AReaL's
  behav_imp_weight_cap):
      obj = sg(w) * min(r A, clip(r) A),  0 where sg(w) > C
- none: no correction, the control of `echo2 bench staleness`: every token trained as if the policy being
  trained had sampled it (the PPO term around pi_prox, with no behaviour weight and nothing dropped):
      obj = min(r A, clip(r) A)        (its gradient: A grad log pi_theta, whatever mu was)
- ppo: AReaL's "naive PPO", the other control: PPO's ratio taken against the behaviour policy, token_tis
  without its dual clip, so a token that became much more likely since it was sampled weighs a negative
  advantage by all of w (w is capped at e^20 only to keep the step finite):
      obj = min(w A, clip(w, 1-eps, 1+eps) A)

    loss = -sum(obj * mask) / sum(mask)  (+ kl_coef * k3(pi_theta, pi_ref))
Token-level averaging (DAPO, Yu et al. 2025) weighs long and short completions by their tokens; a dropped
token still counts in the denominator (as in TRL and AReaL), so dropping shrinks the step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

OFF_POLICY_MODES = ("token_tis", "seq_mask", "geo_mask", "decoupled", "none", "ppo")
PROXIMAL_MODES = ("seq_mask", "geo_mask", "decoupled", "none")  # built on r = pi_theta / pi_prox


class Objective(NamedTuple):
    """Per token, [N, T]: the objective to maximise, and where the PPO clip changed it, where the dual clip
    truncated the weight, where the correction dropped the token."""

    obj: torch.Tensor
    clipped: torch.Tensor
    truncated: torch.Tensor
    dropped: torch.Tensor


def compute_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """rewards: [num_groups, G] → advantages of the same shape. A flat group (all G rewards equal) gets exactly 0:
    its mean can round away from the rewards (0.1 eight times), which would leave noise scaled up by 1 / eps."""
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, keepdim=True, correction=0)
    flat = flat_groups(rewards)[:, None]
    return torch.where(flat, 0.0, (rewards - mean) / (std + eps))


def flat_groups(rewards: torch.Tensor) -> torch.Tensor:
    """rewards: [num_groups, G] → [num_groups] bool: every reward of the group the same, so no learning signal."""
    return rewards.amax(dim=1) == rewards.amin(dim=1)


def _ppo(ratio: torch.Tensor, adv: torch.Tensor, clip_eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """min(ratio A, clip(ratio, 1 - eps, 1 + eps) A) and where the clip won."""
    unclipped = ratio * adv
    obj = torch.minimum(unclipped, torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * adv)
    return obj, obj.detach() != unclipped.detach()


def token_tis(
    log_w: torch.Tensor, log_w_prox: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, p: dict[str, float]
) -> Objective:
    """PPO clip on w and dual clip at C (Ye et al. 2020): a token that became much more likely since it was
    sampled cannot blow up a negative advantage's weight."""
    obj, clipped = _ppo(torch.exp(log_w), adv, p["clip_eps"])
    truncated = (adv < 0) & (obj < p["is_cap"] * adv)
    none = torch.zeros_like(clipped)
    return Objective(torch.where(truncated, p["is_cap"] * adv, obj), clipped | truncated, truncated, none)


def _proximal(
    log_w: torch.Tensor, log_w_prox: torch.Tensor, adv: torch.Tensor, p: dict[str, float]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The PPO term around pi_prox: log r = log pi_theta - log pi_prox = log_w - log_w_prox (log_w_prox =
    log pi_prox - log mu, no gradient)."""
    return _ppo(torch.exp(log_w - log_w_prox), adv, p["clip_eps"])


def seq_mask(
    log_w: torch.Tensor, log_w_prox: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, p: dict[str, float]
) -> Objective:
    """TRL's sequence_mask: rho = exp(sum of the sequence's log w), a constant weight; 0 where rho > C."""
    obj, clipped = _proximal(log_w, log_w_prox, adv, p)
    log_rho = (log_w_prox * mask).sum(dim=1, keepdim=True)
    dropped = (log_rho > torch.log(torch.tensor(p["is_cap"]))).expand_as(obj)
    weight = torch.where(dropped, 0.0, torch.exp(log_rho.clamp(max=20.0)))
    return Objective(obj * weight, clipped, torch.zeros_like(clipped), dropped)


def geo_mask(
    log_w: torch.Tensor, log_w_prox: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, p: dict[str, float]
) -> Objective:
    """SkyRL's geo_mask: drop a sequence unless exp(mean of its log w) lies in [geo_low, geo_high]; no weight."""
    obj, clipped = _proximal(log_w, log_w_prox, adv, p)
    mean = (log_w_prox * mask).sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1.0)
    rho = torch.exp(mean.clamp(-20.0, 20.0))
    dropped = ((rho < p["geo_low"]) | (rho > p["geo_high"])).expand_as(obj)
    return Objective(torch.where(dropped, 0.0, obj), clipped, torch.zeros_like(clipped), dropped)


def decoupled(
    log_w: torch.Tensor, log_w_prox: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, p: dict[str, float]
) -> Objective:
    """AReaL's decoupled PPO: sg(w) * PPO term around pi_prox; tokens with sg(w) > C masked."""
    obj, clipped = _proximal(log_w, log_w_prox, adv, p)
    w = torch.exp(log_w_prox)
    dropped = w > p["is_cap"]
    return Objective(torch.where(dropped, 0.0, w * obj), clipped, torch.zeros_like(clipped), dropped)


def no_correction(
    log_w: torch.Tensor, log_w_prox: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, p: dict[str, float]
) -> Objective:
    """Stale tokens trained as on-policy ones: the PPO term around pi_prox (ratio 1), no weight, none dropped."""
    obj, clipped = _proximal(log_w, log_w_prox, adv, p)
    none = torch.zeros_like(clipped)
    return Objective(obj, clipped, none, none)


def naive_ppo(
    log_w: torch.Tensor, log_w_prox: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, p: dict[str, float]
) -> Objective:
    """AReaL's naive PPO: the PPO clip on w = pi_theta / mu and nothing else (no dual clip, nothing dropped)."""
    capped = torch.exp(log_w.detach().clamp(max=20.0))  # value capped, gradient kept: w grad log pi_theta
    obj, clipped = _ppo(capped * torch.exp(log_w - log_w.detach()), adv, p["clip_eps"])
    none = torch.zeros_like(clipped)
    return Objective(obj, clipped, none, none)


CORRECTIONS: dict[str, Callable[..., Objective]] = {
    "token_tis": token_tis,
    "seq_mask": seq_mask,
    "geo_mask": geo_mask,
    "decoupled": decoupled,
    "none": no_correction,
    "ppo": naive_ppo,
}


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
    off_policy: str = "token_tis",
    geo_low: float = 0.99,
    geo_high: float = 1.01,
    prox_logp: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """logp, behaviour_logp, mask, ref_logp, prox_logp: [N, T]; advantages: [N]. `prox_logp`: the proximal
    policy's log-probs, scored before the batch's first optimizer step (None: pi_prox = sg(pi_theta)). Returns
    (loss, metrics, per-row sums): metrics are means over the completion tokens, 0-d tensors on logp's device
    (the trainer reads a step's metrics back once, not once per micro-batch); the per-row sums ([N] each:
    tokens, KL, w, w^2, clipped and dropped tokens) let the caller total any grouping of rows, such as by
    staleness."""
    mask = mask.to(logp.dtype)
    n_tokens = mask.sum().clamp(min=1.0)
    log_w = logp - behaviour_logp
    log_w_prox = log_w.detach() if prox_logp is None else prox_logp.to(logp.dtype) - behaviour_logp
    adv = advantages[:, None].to(logp.dtype)
    params = {"clip_eps": clip_eps, "is_cap": is_cap, "geo_low": geo_low, "geo_high": geo_high}
    out = CORRECTIONS[off_policy](log_w, log_w_prox, adv, mask, params)
    per_token = -out.obj
    kl = torch.zeros((), dtype=logp.dtype, device=logp.device)
    if ref_logp is not None and kl_coef > 0:
        d = ref_logp - logp
        k3 = torch.exp(d) - d - 1  # Schulman's unbiased, non-negative KL estimator
        per_token = per_token + kl_coef * k3
        kl = (k3 * mask).sum() / n_tokens
    loss = (per_token * mask).sum() / n_tokens
    metrics, rows = _health(log_w.detach(), mask, out, loss.detach(), kl.detach())
    return loss, metrics, rows


@torch.no_grad()
def _health(
    lw: torch.Tensor, mask: torch.Tensor, out: Objective, loss: torch.Tensor, kl: torch.Tensor
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """grpo_loss's metrics (means over the completion tokens) and per-row sums."""
    n_tokens = mask.sum().clamp(min=1.0)
    w = torch.exp(lw)

    def per_row(x: torch.Tensor) -> torch.Tensor:
        return (x.to(lw.dtype) * mask).sum(dim=1)

    rows = {
        "tokens": mask.sum(dim=1),
        "kl_behaviour": per_row(torch.exp(-lw) + lw - 1),  # >= 0, 0 iff pi_theta = mu on the token
        "w": per_row(w),
        "w_sq": per_row(w * w),
        "clipped": per_row(out.clipped),
        "truncated": per_row(out.truncated),
        "dropped": per_row(out.dropped),
    }
    metrics = {
        "train/loss": loss,
        "train/clipfrac": rows["clipped"].sum() / n_tokens,
        "train/is_weight_mean": rows["w"].sum() / n_tokens,
        "train/is_weight_sq_mean": rows["w_sq"].sum() / n_tokens,
        "train/is_weight_max": torch.where(mask > 0, w, 0).max(),
        "train/is_truncated_frac": rows["truncated"].sum() / n_tokens,
        "train/masked_frac": rows["dropped"].sum() / n_tokens,
        "train/kl_behaviour": rows["kl_behaviour"].sum() / n_tokens,
        "train/kl_ref": kl,
    }
    return metrics, rows


def worst_tokens(
    logp: torch.Tensor, behaviour_logp: torch.Tensor, mask: torch.Tensor, k: int = 3
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The k completion tokens where trainer and behaviour log-probs differ most, most first, as device tensors
    (log_w, row, position, valid) with log_w = logp - behaviour_logp; [N, C] inputs are completion-aligned, so a
    position is the token's index in its completion. Fewer than k come back where fewer tokens have a loss:
    the caller reads them back with the step's other metrics, no host sync here (a boolean index would be one):
    k always come back, with `valid` False for a slot past the tokens with a loss, for the caller to drop.

    A token the trainer finds far less likely than the engine said (log_w << 0) is what makes
    `train/kl_behaviour` (mean of exp(-log_w) + log_w - 1) spike: one token at log_w = -10 adds 22,000 to the
    sum. Same-version noise measured 0.36 nats at most (docs/BENCHMARKS.md), so anything past a few nats is
    staleness or a real disagreement worth a look.
    """
    log_w = (logp.detach() - behaviour_logp).flatten()
    gap = torch.where(mask.flatten() > 0, log_w.abs(), -1.0)
    top = torch.topk(gap, min(k, gap.numel()))
    keep = top.indices
    return log_w[keep], keep // mask.shape[1], keep % mask.shape[1], top.values >= 0
