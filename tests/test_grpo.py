import math

import pytest
import torch

from echo2cli.learner.grpo import (
    OFF_POLICY_MODES,
    PROXIMAL_MODES,
    compute_advantages,
    flat_groups,
    grpo_loss,
    worst_tokens,
)


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


def test_a_flat_group_of_rewards_that_do_not_average_exactly_has_zero_advantage():
    """Eight rewards of 0.7 average to 0.7 - 6e-8 in fp32; divided by a std of the same size plus 1e-6, that was an
    advantage of +0.056 on every sample, a push with no signal behind it."""
    rewards = torch.tensor([[0.7] * 8, [0.1] * 8, [0.0, 1.0] * 4])
    adv = compute_advantages(rewards)
    assert torch.all(adv[:2] == 0) and torch.all(adv[2].abs() > 0.99)
    assert flat_groups(rewards).tolist() == [True, True, False]


def test_loss_matches_a_plain_loop_including_clipping_and_truncation():
    g = torch.Generator().manual_seed(1)
    logp = -torch.rand(5, 7, generator=g) * 3
    blogp = logp + torch.randn(5, 7, generator=g) * 1.5  # ratios far from 1: both clips are active
    adv = torch.tensor([1.5, -2.0, 0.3, -0.7, 0.0])
    mask = (torch.rand(5, 7, generator=g) > 0.2).float()
    loss, metrics, _ = grpo_loss(logp, blogp, adv, mask, clip_eps=0.2, is_cap=3.0)
    expected = loop_loss(logp.tolist(), blogp.tolist(), adv.tolist(), mask.tolist(), 0.2, 3.0)
    assert abs(float(loss) - expected) < 1e-5
    assert 0 < metrics["train/clipfrac"] < 1
    assert metrics["train/is_truncated_frac"] > 0


def test_on_policy_gradient_raises_logp_of_positive_advantage_tokens():
    logp = torch.log(torch.tensor([[0.5, 0.5]])).requires_grad_(True)
    loss, metrics, _ = grpo_loss(logp, logp.detach(), torch.tensor([1.0]), torch.ones(1, 2))
    loss.backward()
    assert torch.all(logp.grad < 0)  # descending the loss increases logp
    assert metrics["train/clipfrac"] == 0 and metrics["train/is_weight_mean"] == 1


def test_kl_term_is_zero_at_the_reference_and_positive_away_from_it():
    logp = torch.log(torch.tensor([[0.2, 0.7]]))
    _, at_ref, _ = grpo_loss(logp, logp, torch.tensor([0.0]), torch.ones(1, 2), ref_logp=logp, kl_coef=0.1)
    _, away, _ = grpo_loss(logp, logp, torch.tensor([0.0]), torch.ones(1, 2), ref_logp=logp - 0.5, kl_coef=0.1)
    assert at_ref["train/kl_ref"] == 0 and away["train/kl_ref"] > 0


def test_worst_tokens_names_the_largest_gaps_by_completion_position():
    # two rows, completion-aligned: column j is completion token j; row 1's token 0 has no loss (mask 0)
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-9.0, -1.0, -12.0]])
    behaviour = torch.tensor([[-1.1, -2.0, -0.5], [0.0, -1.0, -2.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 1.0]])
    log_w, rows, positions, valid = worst_tokens(logp, behaviour, mask, k=2)
    assert list(zip(rows.tolist(), positions.tolist(), strict=True)) == [(1, 2), (0, 0)]  # the -9 gap has no loss
    assert log_w.tolist() == pytest.approx([-10.0, 0.1])
    assert valid.tolist() == [True, True]
    *_, valid = worst_tokens(logp, behaviour, mask, k=6)  # 5 tokens have a loss: the sixth slot is not one
    assert valid.tolist() == [True] * 5 + [False]
    *_, valid = worst_tokens(logp, behaviour, torch.zeros_like(mask))
    assert not valid.any()


# -- off-policy corrections against hand-computed values: 2 sequences x 2 tokens, A = [+1, -1] ---------------


def corrected(log_w: list[list[float]], mode: str, **kw):
    """Loss, metrics and d loss / d logp for behaviour log-probs of -1 and the given log w = logp - behaviour."""
    behaviour = torch.full((2, 2), -1.0)
    logp = (behaviour + torch.tensor(log_w)).requires_grad_()
    loss, metrics, rows = grpo_loss(logp, behaviour, torch.tensor([1.0, -1.0]), torch.ones(2, 2), off_policy=mode, **kw)
    loss.backward()
    return float(loss.detach()), metrics, logp.grad, rows


def test_seq_mask_weighs_a_sequence_by_its_product_ratio_and_drops_it_past_the_cap():
    # row 0: rho = e^(0.1 + 0.2) = 1.3499 <= 3, weight 1.3499; row 1: rho = e^1.2 = 3.32 > 3, dropped
    loss, m, grad, _ = corrected([[0.1, 0.2], [0.6, 0.6]], "seq_mask", is_cap=3.0)
    rho = math.exp(0.3)
    assert loss == pytest.approx(-(2 * rho) / 4)
    torch.testing.assert_close(grad, torch.tensor([[-rho / 4, -rho / 4], [0.0, 0.0]]))
    assert m["train/masked_frac"] == 0.5 and m["train/is_truncated_frac"] == 0.0


def test_geo_mask_keeps_only_sequences_whose_mean_ratio_is_near_one_and_gives_them_no_weight():
    # row 0: exp(mean(0.005, 0.005)) = 1.005, kept; row 1: exp(mean(0, 0.05)) = 1.0253 > 1.01, dropped
    loss, m, grad, _ = corrected([[0.005, 0.005], [0.0, 0.05]], "geo_mask", geo_low=0.99, geo_high=1.01)
    assert loss == pytest.approx(-2 / 4)
    torch.testing.assert_close(grad, torch.tensor([[-0.25, -0.25], [0.0, 0.0]]))
    assert m["train/masked_frac"] == 0.5
    _, m_low, _, _ = corrected([[-0.005, -0.005], [-0.05, 0.0]], "geo_mask")  # two-sided: 0.975 < 0.99 dropped
    assert m_low["train/masked_frac"] == 0.5


def test_decoupled_weighs_each_token_by_its_behaviour_ratio_and_masks_those_past_the_cap():
    # w = [[2, 4], [1, 0.5]]; C = 3 masks (0, 1); obj = w * A at r = pi / pi_prox = 1
    log_w = [[math.log(2), math.log(4)], [0.0, math.log(0.5)]]
    loss, m, grad, _ = corrected(log_w, "decoupled", is_cap=3.0)
    assert loss == pytest.approx(-(2 + 0 - 1 - 0.5) / 4)
    torch.testing.assert_close(grad, torch.tensor([[-0.5, 0.0], [0.25, 0.125]]))
    assert m["train/masked_frac"] == 0.25


def test_decoupled_clips_around_the_proximal_policy_not_the_behaviour_one():
    # a far-off token (w = 2) with A > 0: token_tis clips it (no gradient), decoupled keeps the gradient, weighted
    _, m_tis, grad_tis, _ = corrected([[math.log(2), 0.0], [0.0, 0.0]], "token_tis")
    _, m_dec, grad_dec, _ = corrected([[math.log(2), 0.0], [0.0, 0.0]], "decoupled")
    assert grad_tis[0, 0] == 0.0 and m_tis["train/clipfrac"] == 0.25
    assert grad_dec[0, 0] == pytest.approx(-2 / 4) and m_dec["train/clipfrac"] == 0.0


@pytest.mark.parametrize("mode", OFF_POLICY_MODES)
def test_a_proximal_policy_equal_to_the_trained_one_changes_nothing(mode):
    # a batch's first mini-batch: pi_prox = sg(pi_theta), given or not
    log_w = [[0.3, -0.4], [math.log(2), 0.1]]
    loss, m, grad, _ = corrected(log_w, mode)
    behaviour = torch.full((2, 2), -1.0)
    given = corrected(log_w, mode, prox_logp=behaviour + torch.tensor(log_w))
    assert given[0] == pytest.approx(loss) and given[1]["train/clipfrac"] == m["train/clipfrac"]
    torch.testing.assert_close(given[2], grad)


def test_decoupled_in_a_later_mini_batch_clips_r_against_the_batchs_start_and_weighs_by_its_behaviour_ratio():
    # pi_prox / mu = 2 on every token; the step before moved pi_theta to r = pi_theta / pi_prox = [[1.5, 1.1], [0.5, 1]]
    behaviour = torch.full((2, 2), -1.0)
    prox = behaviour + math.log(2)
    r = torch.tensor([[1.5, 1.1], [0.5, 1.0]])
    log_w = (prox - behaviour + torch.log(r)).tolist()
    loss, m, grad, _ = corrected(log_w, "decoupled", prox_logp=prox)
    # A = +1 on row 0: r = 1.5 is clipped at 1.2 (no gradient), 1.1 is not; A = -1 on row 1: r = 0.5 clipped at 0.8
    assert loss == pytest.approx(-2 * (1.2 + 1.1 - 0.8 - 1.0) / 4)
    torch.testing.assert_close(grad, torch.tensor([[0.0, -2 * 1.1 / 4], [0.0, 2 * 1.0 / 4]]))
    assert m["train/clipfrac"] == 0.5 and m["train/masked_frac"] == 0.0


def test_only_the_corrections_built_on_the_proximal_ratio_read_the_proximal_policy():
    log_w = [[0.005, -0.004], [0.002, 0.001]]  # near mu, so that geo_mask keeps every sequence
    far = torch.full((2, 2), -1.0) + 1.5  # pi_prox far from pi_theta and mu: every r clipped, every weight past C
    for mode in OFF_POLICY_MODES:
        same = torch.allclose(corrected(log_w, mode)[2], corrected(log_w, mode, prox_logp=far)[2])
        assert same == (mode not in PROXIMAL_MODES), mode


def test_none_trains_stale_tokens_as_on_policy_ones_whatever_the_behaviour_policy():
    # the same gradient, A / n_tokens per token, for any log w: far-off tokens are neither weighted nor dropped
    for log_w in ([[0.0, 0.0], [0.0, 0.0]], [[math.log(4), -2.0], [3.0, math.log(0.1)]]):
        loss, m, grad, _ = corrected(log_w, "none", is_cap=3.0)
        assert loss == pytest.approx(0.0)  # (1 + 1 - 1 - 1) / 4 at r = 1
        torch.testing.assert_close(grad, torch.tensor([[-0.25, -0.25], [0.25, 0.25]]))
        assert m["train/masked_frac"] == 0.0 and m["train/is_truncated_frac"] == 0.0 and m["train/clipfrac"] == 0.0


def test_ppo_is_token_tis_without_the_dual_clip():
    # the same row 1 as below (A = -1, w = e^2 > C): token_tis truncates it to C * A, naive PPO keeps w * A and
    # its gradient, w / n_tokens
    loss, m, grad, _ = corrected([[0.0, 0.0], [2.0, 0.0]], "ppo", is_cap=3.0)
    assert loss == pytest.approx(-(1 + 1 - math.exp(2) - 1) / 4)
    assert grad[1, 0] == pytest.approx(math.exp(2) / 4) and grad[1, 1] == pytest.approx(0.25)
    assert m["train/is_truncated_frac"] == 0.0 and m["train/masked_frac"] == 0.0


def test_ppo_keeps_a_far_off_token_finite():
    _, _, grad, _ = corrected([[0.0, 0.0], [200.0, 0.0]], "ppo")
    assert torch.isfinite(grad).all() and grad[1, 0] == pytest.approx(math.exp(20) / 4, rel=1e-4)


def test_token_tis_is_the_default_and_counts_dual_clip_truncation():
    # row 1 has A = -1 and w = e^2 = 7.39 > C = 3 on its first token: truncated to C * A (no gradient)
    loss, m, grad, _ = corrected([[0.0, 0.0], [2.0, 0.0]], "token_tis", is_cap=3.0)
    assert loss == pytest.approx(-(1 + 1 - 3 - 1) / 4)
    assert grad[1, 0] == 0.0 and grad[1, 1] == pytest.approx(0.25)
    assert m["train/is_truncated_frac"] == 0.25 and m["train/masked_frac"] == 0.0


def test_per_row_sums_give_the_weights_ess_and_kl():
    _, m, _, rows = corrected([[0.0, math.log(3)], [0.0, 0.0]], "token_tis")
    torch.testing.assert_close(rows["w"], torch.tensor([4.0, 2.0]))
    torch.testing.assert_close(rows["w_sq"], torch.tensor([10.0, 2.0]))
    assert m["train/is_weight_mean"] == pytest.approx(6 / 4) and m["train/is_weight_sq_mean"] == pytest.approx(12 / 4)
    kl_token = 1 / 3 + math.log(3) - 1  # exp(-log w) + log w - 1
    assert rows["kl_behaviour"][0] == pytest.approx(kl_token) and rows["kl_behaviour"][1] == 0.0
