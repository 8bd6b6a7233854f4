import math

import pytest
import torch

from echo2cli.learner.grpo import compute_advantages, grpo_loss, worst_tokens


def loop_advantages(rewards):
    out = []
    for group in rewards:
        mean = sum(group) / len(group)
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / len(group))
        out.append([(r - mean) / (std + 1e-6) for r in group])
    return out


def loop_loss(logp, blogp, adv, mask, eps, cap):
    total, n = 0.0, 0
    for i in range(len(logp)):
        for j in range(len(logp[i])):
            if not mask[i][j]:
                continue
            w = math.exp(logp[i][j] - blogp[i][j])
            a = adv[i]
            obj = min(w * a, min(max(w, 1 - eps), 1 + eps) * a)
            if a < 0:
                obj = max(obj, cap * a)
            total += -obj
            n += 1
    return total / n


def test_advantages_match_a_plain_loop():
    g = torch.Generator().manual_seed(0)
    rewards = torch.randint(0, 2, (6, 8), generator=g).float()
    assert torch.allclose(compute_advantages(rewards), torch.tensor(loop_advantages(rewards.tolist())), atol=1e-5)


def test_group_with_equal_rewards_has_zero_advantage():
    assert torch.all(compute_advantages(torch.ones(1, 4)) == 0)


def test_loss_matches_a_plain_loop_including_clipping_and_truncation():
    g = torch.Generator().manual_seed(1)
    logp = -torch.rand(5, 7, generator=g) * 3
    blogp = logp + torch.randn(5, 7, generator=g) * 1.5  # ratios far from 1: both clips are active
    adv = torch.tensor([1.5, -2.0, 0.3, -0.7, 0.0])
    mask = (torch.rand(5, 7, generator=g) > 0.2).float()
    loss, metrics = grpo_loss(logp, blogp, adv, mask, clip_eps=0.2, is_cap=3.0)
    expected = loop_loss(logp.tolist(), blogp.tolist(), adv.tolist(), mask.tolist(), 0.2, 3.0)
    assert abs(float(loss) - expected) < 1e-5
    assert 0 < metrics["train/clipfrac"] < 1
    assert metrics["train/is_truncated_frac"] > 0


def test_on_policy_gradient_raises_logp_of_positive_advantage_tokens():
    logp = torch.log(torch.tensor([[0.5, 0.5]])).requires_grad_(True)
    loss, metrics = grpo_loss(logp, logp.detach(), torch.tensor([1.0]), torch.ones(1, 2))
    loss.backward()
    assert torch.all(logp.grad < 0)  # descending the loss increases logp
    assert metrics["train/clipfrac"] == 0 and metrics["train/is_weight_mean"] == 1


def test_kl_term_is_zero_at_the_reference_and_positive_away_from_it():
    logp = torch.log(torch.tensor([[0.2, 0.7]]))
    _, at_ref = grpo_loss(logp, logp, torch.tensor([0.0]), torch.ones(1, 2), ref_logp=logp, kl_coef=0.1)
    _, away = grpo_loss(logp, logp, torch.tensor([0.0]), torch.ones(1, 2), ref_logp=logp - 0.5, kl_coef=0.1)
    assert at_ref["train/kl_ref"] == 0 and away["train/kl_ref"] > 0


def test_worst_tokens_names_the_largest_gaps_by_completion_position():
    # two rows; completions start at column 1 (row 0) and column 2 (row 1); column 0 of row 1 is prompt
    logp = torch.tensor([[0.0, -1.0, -2.0, -0.5], [-9.0, 0.0, -1.0, -12.0]])
    behaviour = torch.tensor([[0.0, -1.1, -2.0, -0.5], [0.0, 0.0, -1.0, -2.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0], [0.0, 0.0, 1.0, 1.0]])
    top = worst_tokens(logp, behaviour, mask, k=2)
    assert [(r, p) for r, p, _ in top] == [(1, 1), (0, 0)]  # the -9 gap sits in the prompt: not counted
    assert top[0][2] == pytest.approx(-10.0) and top[1][2] == pytest.approx(0.1)
    assert worst_tokens(logp, behaviour, torch.zeros_like(mask)) == []
