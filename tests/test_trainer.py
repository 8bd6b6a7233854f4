"""Trainer math on a tiny randomly initialised Llama (no pretrained weights needed)."""

import math

import pytest
import torch

from echo2cli.errors import ConfigError
from echo2cli.learner.trainer import Trainer
from echo2cli.learner.types import Group
from echo2cli.protocol import Sample


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        pad_token_id=0,
    )
    path = tmp_path_factory.mktemp("tiny")
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def make_trainer(path, lr=1e-2, **overrides):
    kwargs = dict(lr=lr, clip_eps=0.2, is_cap=3.0, kl_coef=0.0, max_grad_norm=1.0, micro_batch=3) | overrides
    return Trainer(path, **kwargs)


def logp_of(trainer, prompt, completion):
    ids = torch.tensor([prompt + completion], device=trainer.device)
    with torch.no_grad():
        logits = trainer.model(input_ids=ids).logits[0, :-1].float()
    lp = torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None])[:, 0]
    return lp[len(prompt) - 1 :]


def test_completion_logp_matches_a_full_forward_pass(tiny_model_dir):
    tr = make_trainer(tiny_model_dir)
    rows = [([5, 6, 7], [8, 9], [-1.0, -1.0]), ([5], [10, 11, 12], [-1.0] * 3)]
    with torch.no_grad():
        got = tr._token_logp(tr.model, tr._pack(rows))
    atol = 5e-2 if tr.autocast else 1e-5  # bf16 autocast (CUDA) against the fp32 forward here
    for i, (p, c, _) in enumerate(rows):
        expected = logp_of(tr, p, c)
        assert torch.allclose(got[i, : len(c)], expected, atol=atol)


def test_a_step_makes_the_rewarded_completion_more_likely(tiny_model_dir):
    tr = make_trainer(tiny_model_dir)
    prompt, good, bad = [5, 6], [20, 21], [30, 31]
    before_good, before_bad = logp_of(tr, prompt, good).sum(), logp_of(tr, prompt, bad).sum()
    samples = [
        Sample(prompt_id=0, sample_idx=i, completion_token_ids=c, logprobs=logp_of(tr, prompt, c).tolist())
        for i, c in enumerate([good, bad, good, bad])
    ]
    metrics = tr.step([Group(0, 0, prompt, samples, [1.0, 0.0, 1.0, 0.0], "w")])
    assert logp_of(tr, prompt, good).sum() > before_good
    assert logp_of(tr, prompt, bad).sum() < before_bad
    assert metrics["train/tokens"] == 8 and abs(metrics["train/is_weight_mean"] - 1) < 1e-4


def test_each_step_takes_the_schedules_rate_for_the_version_it_trains(tiny_model_dir):
    from echo2cli.learner.schedule import LrSchedule

    sched = LrSchedule(1e-2, 10, "cosine", warmup_steps=2)
    tr = make_trainer(tiny_model_dir, lr_schedule=sched)
    prompt = [5, 6]
    samples = [Sample(prompt_id=0, sample_idx=i, completion_token_ids=[20 + i], logprobs=[-1.0]) for i in range(2)]
    for version in (0, 7):  # a resumed run's first step takes its version's rate, not the first step's
        metrics = tr.step([Group(0, version, prompt, samples, [1.0, 0.0], "w")], version)
        assert metrics["train/lr"] == sched.at(version) == tr.opt.param_groups[0]["lr"]
    assert make_trainer(tiny_model_dir).step([Group(0, 0, prompt, samples, [1.0, 0.0], "w")], 3)["train/lr"] == 1e-2


def test_the_learners_schedule_options_reach_its_trainer(tiny_model_dir):
    from echo2cli.config import LearnerConfig, load_config
    from echo2cli.learner.loop import build_trainer
    from echo2cli.learner.schedule import LrSchedule

    given = {"steps": 30, "lr": 3e-5, "lr_schedule": "linear", "lr_warmup_steps": 4, "lr_min_ratio": 0.1}
    tr = build_trainer(load_config(LearnerConfig, None, given, "learner"), tiny_model_dir)
    assert tr.lr_schedule == LrSchedule(3e-5, 30, "linear", 4, 0.1)


def test_exported_weights_are_bf16_without_the_tied_head(tiny_model_dir, tmp_path):
    from safetensors import safe_open

    tr = make_trainer(tiny_model_dir)
    tr.export_weights(tmp_path / "v" / "model.safetensors")
    with safe_open(str(tmp_path / "v" / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
        assert "lm_head.weight" not in keys
        assert all(f.get_tensor(k).dtype == torch.bfloat16 for k in keys)


def test_tokens_are_scored_at_the_sampling_temperature(tiny_model_dir):
    tr = make_trainer(tiny_model_dir)
    tr.temperature = 0.5
    prompt, completion = [5, 6, 7], [8, 9]
    with torch.no_grad():
        got = tr._token_logp(tr.model, tr._pack([(prompt, completion, [-1.0, -1.0])]))[0]
        seq = torch.tensor([prompt + completion], device=tr.device)
        logits = tr.model(input_ids=seq).logits[0, :-1].float() / 0.5
    expected = torch.log_softmax(logits, -1).gather(1, seq[0, 1:, None])[:, 0][len(prompt) - 1 :]
    atol = 5e-2 if tr.autocast else 1e-5
    assert torch.allclose(got, expected, atol=atol)
    assert not torch.allclose(got, logp_of(tr, prompt, completion), atol=atol)  # T = 1 would differ


def test_the_head_in_chunks_gives_the_same_log_probs_and_gradients(tiny_model_dir, monkeypatch):
    from echo2cli.learner import trainer as trainer_module

    rows = [([5, 6, 7], [8, 9, 10, 11, 12], [-1.0] * 5), ([5], [10, 11, 12, 13], [-1.0] * 4)]
    results = []
    for chunk in (4096, 3):  # one pass, then 9 completion positions in chunks of 3
        monkeypatch.setattr(trainer_module, "LOGIT_CHUNK", chunk)
        tr = make_trainer(tiny_model_dir)
        tr.autocast = False
        logp = tr._token_logp(tr.policy, tr._pack(rows))
        logp.sum().backward()
        results.append((logp.detach(), [p.grad.clone() for p in tr.model.parameters()]))
    (a, grads_a), (b, grads_b) = results
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    for x, y in zip(grads_a, grads_b, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


SHARED_ROWS = [  # prompts of three lengths, two of them repeated (a GRPO group's samples), completions of 1-5 tokens
    ([5, 6, 7, 8], [9, 10, 11], [-1.0] * 3),
    ([5, 6], [12, 13, 14, 15, 16], [-1.0] * 5),
    ([5, 6, 7, 8], [17], [-1.0]),
    ([3], [18, 19], [-1.0] * 2),
    ([5, 6], [20, 21], [-1.0] * 2),
    ([5, 6, 7, 8], [22, 23, 24, 25], [-1.0] * 4),
]


def test_a_shared_prompt_run_once_gives_the_same_log_probs_and_gradients(tiny_model_dir):
    from echo2cli.learner.trainer import TokenLogp

    results = []
    for share in (False, True):
        tr = make_trainer(tiny_model_dir)
        tr.autocast = False
        policy = tr.policy = TokenLogp(tr.model, share_prompts=share)
        logp = tr._token_logp(policy, tr._pack(SHARED_ROWS))
        (logp * torch.arange(logp.numel()).reshape(logp.shape)).sum().backward()  # every position counts
        results.append((logp.detach(), [p.grad.clone() for p in tr.model.parameters()]))
    (a, grads_a), (b, grads_b) = results
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert torch.equal(a != 0, b != 0)  # the same completion positions scored
    for x, y in zip(grads_a, grads_b, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5)


def test_a_packed_micro_batch_holds_each_distinct_prompt_once_and_no_pad_token(tiny_model_dir):
    tr = make_trainer(tiny_model_dir)
    distinct = [([5, 6], [7], [-1.0]), ([5, 6, 7], [8], [-1.0])]  # one is a prefix of the other: still distinct
    assert tr._pack(distinct).n_prompt_tokens == 5
    pack = tr._pack(SHARED_ROWS)
    assert pack.n_prompt_tokens == 4 + 2 + 1  # three distinct prompts, each once
    assert pack.tokens == 7 + sum(len(c) for _, c, _ in SHARED_ROWS)
    assert pack.position_ids[0, :7].tolist() == [0, 1, 2, 3, 0, 1, 0]
    assert pack.position_ids[0, 7:10].tolist() == [4, 5, 6]  # row 0's completion continues after its prompt
    tr.policy.share_prompts = False
    assert tr._pack(SHARED_ROWS).n_prompt_tokens == sum(len(p) for p, _, _ in SHARED_ROWS)


def test_a_step_with_shared_prompts_moves_the_weights_like_one_without(tiny_model_dir):
    updated = []
    for share in (False, True):
        tr = make_trainer(tiny_model_dir, micro_batch=4, share_prompts=share)
        tr.autocast = False
        groups = [
            Group(
                prompt_id=k,
                prompt_token_ids=prompt,
                samples=[
                    Sample(prompt_id=k, sample_idx=i, completion_token_ids=c, logprobs=[-1.0] * len(c))
                    for i, c in enumerate(completions)
                ],
                rewards=[1.0, 0.0, 0.5, 0.0],
                version=0,
                worker_id="w",
            )
            for k, (prompt, completions) in enumerate(
                [([5, 6, 7], [[8], [9, 10], [11, 12, 13], [14]]), ([3, 4], [[15, 16], [17], [18], [19, 20, 21]])]
            )
        ]
        metrics = tr.step(groups, version=0)
        updated.append((metrics, [p.detach().clone() for p in tr.model.parameters()]))
    (m_a, w_a), (m_b, w_b) = updated
    for x, y in zip(w_a, w_b, strict=True):  # lr 1e-2: a step that differed would move weights by ~1e-2
        torch.testing.assert_close(x, y, rtol=1e-3, atol=1e-4)
    assert m_a["train/tokens"] == m_b["train/tokens"]
    assert abs(m_a["train/kl_behaviour"] - m_b["train/kl_behaviour"]) < 1e-4


def two_groups(tr):
    """Two prompts, each with a rewarded and an unrewarded completion, sampled by the trainer's own policy."""
    out = []
    for pid, prompt in enumerate([[5, 6], [7, 8, 9]]):
        completions = [[20, 21], [30, 31, 32], [20, 21], [33]]
        samples = [
            Sample(prompt_id=pid, sample_idx=i, completion_token_ids=c, logprobs=logp_of(tr, prompt, c).tolist())
            for i, c in enumerate(completions)
        ]
        out.append(Group(pid, 0, prompt, samples, [1.0, 0.0, 1.0, 0.0], "w"))
    return out


def weights(tr):
    return [p.detach().clone() for p in tr.model.parameters()]


def test_two_mini_batches_are_two_steps_on_the_groups_in_turn(tiny_model_dir):
    """token_tis weighs by pi_theta / mu alone, so a batch in two mini-batches is one step on each group in turn;
    the metrics are the whole batch's."""
    both = make_trainer(tiny_model_dir, minibatches=2)
    groups = two_groups(both)
    metrics = both.step(groups)
    in_turn = make_trainer(tiny_model_dir)
    firsts = [in_turn.step([g]) for g in groups]
    for x, y in zip(weights(both), weights(in_turn), strict=True):
        torch.testing.assert_close(x, y)
    assert [float(s["step"]) for s in both.opt.state.values()][0] == 2.0
    assert metrics["train/tokens"] == sum(m["train/tokens"] for m in firsts) == 16
    assert metrics["train/is_weight_mean"] == pytest.approx(
        sum(m["train/is_weight_mean"] * m["train/tokens"] for m in firsts) / 16
    )


def test_a_later_mini_batch_of_decoupled_clips_against_the_batchs_start(tiny_model_dir):
    """decoupled's PPO ratio is taken against the policy before the batch's first step: in the second
    mini-batch the first step has moved it (lr 5e-2), and the clip acts. One step per group, each its own batch,
    never clips (r = 1)."""
    both = make_trainer(tiny_model_dir, lr=5e-2, minibatches=2, off_policy="decoupled")
    groups = two_groups(both)
    assert both.step(groups)["train/clipfrac"] > 0
    in_turn = make_trainer(tiny_model_dir, lr=5e-2, off_policy="decoupled")
    assert [in_turn.step([g])["train/clipfrac"] for g in groups] == [0.0, 0.0]
    moved = [not torch.allclose(x, y) for x, y in zip(weights(both), weights(in_turn), strict=True)]
    assert any(moved)


def flat_group(tr, pid, reward):
    """A group whose samples all got `reward`: advantage 0 on every token."""
    prompt, completions = [4, 5, 6], [[40, 41], [42], [43, 44, 45], [46]]
    samples = [
        Sample(prompt_id=pid, sample_idx=i, completion_token_ids=c, logprobs=(logp_of(tr, prompt, c) - 0.3).tolist())
        for i, c in enumerate(completions)
    ]
    return Group(pid, 0, prompt, samples, [reward] * 4, "w")


def packed_rows(tr):
    """Record the rows of every micro-batch the trainer packs (forward passes) into the returned list."""
    seen: list[int] = []
    pack = tr._pack
    tr._pack = lambda rows: seen.append(len(rows)) or pack(rows)
    return seen


def test_a_flat_group_gets_no_pass_and_the_step_is_the_same(tiny_model_dir):
    """A group whose rewards are all equal adds nothing to the gradient (advantage 0, no KL term): skipped, it still
    counts in the token mean, so the weights move as with its pass. Its tokens leave the health metrics."""
    runs = {}
    for skip in (False, True):
        tr = make_trainer(tiny_model_dir, micro_batch=4, skip_flat_groups=skip)
        tr.autocast = False
        groups = two_groups(tr) + [flat_group(tr, 2, 1.0)]
        seen = packed_rows(tr)
        runs[skip] = tr.step(groups), weights(tr), seen
    (m_all, w_all, seen_all), (m_skip, w_skip, seen_skip) = runs[False], runs[True]
    for x, y in zip(w_all, w_skip, strict=True):
        torch.testing.assert_close(x, y)
    assert sum(seen_all) == 12 and sum(seen_skip) == 8
    assert m_skip["train/tokens"] == m_all["train/tokens"] == 23
    assert m_skip["train/loss"] == pytest.approx(m_all["train/loss"], abs=1e-6)
    assert m_skip["train/trained_frac"] == pytest.approx(16 / 23) and m_all["train/trained_frac"] == 1.0
    assert m_skip["offpolicy/by_staleness"]["0"]["tokens"] == 16  # the flat group's w = e^0.3 is not in them
    assert m_skip["train/is_weight_mean"] == pytest.approx(1.0, abs=1e-4)
    assert m_all["train/is_weight_mean"] == pytest.approx((16 + 7 * math.exp(0.3)) / 23, abs=1e-3)


def test_a_batch_of_flat_groups_gets_no_pass_and_adamw_still_steps_on_its_moments(tiny_model_dir):
    after = {}
    for skip in (False, True):
        tr = make_trainer(tiny_model_dir, micro_batch=4, skip_flat_groups=skip)
        tr.autocast = False
        tr.step(two_groups(tr))
        before = weights(tr)
        seen = packed_rows(tr)
        m = tr.step([flat_group(tr, 0, 0.0), flat_group(tr, 1, 1.0)])
        assert any(not torch.equal(x, y) for x, y in zip(before, weights(tr), strict=True))  # the moments move it
        after[skip] = weights(tr), seen, m
    (w_all, seen_all, m_all), (w_skip, seen_skip, m_skip) = after[False], after[True]
    for x, y in zip(w_all, w_skip, strict=True):
        torch.testing.assert_close(x, y)
    assert seen_all and not seen_skip
    assert m_skip["train/trained_frac"] == 0.0 and m_skip["train/grad_norm"] == m_all["train/grad_norm"] == 0.0
    assert "train/is_ess" not in m_skip  # no trained token: nothing for the divergence guard to judge
    assert m_skip["train/loss"] == 0.0 and m_all["train/loss"] == pytest.approx(0.0, abs=1e-7)


def test_with_a_kl_term_a_flat_group_is_trained(tiny_model_dir):
    tr = make_trainer(tiny_model_dir, kl_coef=0.1, micro_batch=4)
    seen = packed_rows(tr)
    m = tr.step(two_groups(tr) + [flat_group(tr, 2, 1.0)])
    assert sum(seen) == 12 and m["train/trained_frac"] == 1.0


def test_off_policy_health_is_told_by_staleness_bucket(tiny_model_dir):
    """Trained at version 5, groups of versions 5 and 2 land in buckets 0 and 3 with their own token counts."""
    tr = make_trainer(tiny_model_dir)
    prompt = [5, 6]

    def group(pid, version, completion):
        lp = logp_of(tr, prompt, completion).tolist()
        samples = [Sample(prompt_id=pid, sample_idx=i, completion_token_ids=completion, logprobs=lp) for i in range(2)]
        return Group(pid, version, prompt, samples, [1.0, 0.0], "w")

    m = tr.step([group(0, 5, [20, 21]), group(1, 2, [30, 31, 32])], version=5)
    buckets = m["offpolicy/by_staleness"]
    assert set(buckets) == {"0", "3"}
    assert buckets["0"]["tokens"] == 4 and buckets["3"]["tokens"] == 6
    assert buckets["3"]["is_ess"] == pytest.approx(1.0, abs=1e-4)  # log-probs from this very policy: w = 1
    assert m["train/is_ess"] == pytest.approx(1.0, abs=1e-4) and m["train/masked_frac"] == 0.0


def test_a_transcripts_environment_tokens_carry_no_loss(tiny_model_dir):
    tr = make_trainer(tiny_model_dir)
    row = ([5, 6], [7, 8, 9, 10, 11], [-1.0, -1.0, 0.0, 0.0, -1.0], [1, 1, 0, 0, 1])  # policy, env, policy
    pack = tr._pack([row, row])
    assert pack.mask[0].tolist() == [1, 1, 0, 0, 1] and pack.loss_tokens == 2 * 3
    with torch.no_grad():
        logp = tr._token_logp(tr.model, pack)
    assert torch.equal(logp[0] != 0, pack.mask[0] > 0)  # the environment's tokens are not scored
    samples = [
        Sample(prompt_id=0, sample_idx=i, completion_token_ids=row[1], logprobs=row[2], policy_mask=row[3])
        for i in range(2)
    ]
    metrics = tr.step([Group(0, 0, row[0], samples, [1.0, 0.0], "w")])
    assert metrics["train/tokens"] == 2 * 3  # the policy's tokens alone


def test_the_bf16_head_is_fp32_arithmetic_on_bf16_operands_with_fp32_logits():
    """`Bf16Logits` (the head's matmuls where the layers compute in bf16 on CUDA): forward and both gradients equal
    fp32 matmuls on the bf16-rounded operands (what cuBLAS's bf16 GEMM with fp32 accumulation computes), and the
    logits keep fp32 precision: none is rounded to bf16."""
    from echo2cli.learner.trainer import Bf16Logits

    g = torch.Generator().manual_seed(0)
    hidden = (torch.randn(6, 32, generator=g) * 3).requires_grad_()
    weight = torch.randn(50, 32, generator=g).requires_grad_()
    logits = Bf16Logits.apply(hidden, weight)
    upstream = torch.randn(logits.shape, generator=g)
    logits.backward(upstream)
    h, w = (x.detach().bfloat16().float().requires_grad_() for x in (hidden, weight))
    want = h @ w.t()
    want.backward(upstream.bfloat16().float())
    assert logits.dtype == hidden.grad.dtype == weight.grad.dtype == torch.float32
    torch.testing.assert_close(logits, want, rtol=0, atol=0)
    torch.testing.assert_close(hidden.grad, h.grad, rtol=0, atol=0)
    torch.testing.assert_close(weight.grad, w.grad, rtol=0, atol=0)
    assert not torch.equal(logits, logits.bfloat16().float())  # fp32 logits, not bf16 ones


def published_logp(trainer, directory, prompt, completion):
    """Log-probs of `completion` under the version the trainer publishes now (its weights in bf16), as an engine
    computing in fp32 would score them."""
    from transformers import AutoModelForCausalLM

    trainer.export_weights(directory / "model.safetensors")
    trainer.model.config.save_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1).gather(1, ids[0, 1:, None])[:, 0]
    return lp[len(prompt) - 1 :]


@pytest.mark.parametrize("wire", [torch.bfloat16, torch.float16])
def test_the_trainer_scores_with_the_weights_it_publishes(tiny_model_dir, tmp_path, wire):
    """Workers sample from the published weights (bf16 or fp16). After a step the fp32 weights are off that grid,
    yet at staleness 0 the trainer must score the policy the workers sampled from: w = 1 on every token."""
    tr = make_trainer(tiny_model_dir, lr=1e-2, bf16=False, wire_dtype=wire)
    prompt, good, bad = [5, 6], [20, 21, 22], [30, 31, 32]

    def group(version, score):
        completions = [good, bad, good, bad]
        samples = [
            Sample(prompt_id=version, sample_idx=i, completion_token_ids=c, logprobs=score(c).tolist())
            for i, c in enumerate(completions)
        ]
        return Group(version, version, prompt, samples, [1.0, 0.0, 1.0, 0.0], "w")

    tr.step([group(0, lambda c: published_logp(tr, tmp_path / "v0", prompt, c))], version=0)
    fp32_gap = (logp_of(tr, prompt, good) - published_logp(tr, tmp_path / "v1", prompt, good)).abs().max()
    m = tr.step([group(1, lambda c: published_logp(tr, tmp_path / "v1", prompt, c))], version=1)
    assert fp32_gap > (1e-3 if wire == torch.bfloat16 else 1e-5)  # the fp32 weights are another policy (w != 1)
    assert m["train/abs_log_ratio_max"] < 1e-5 and m["train/is_ess"] == pytest.approx(1.0, abs=1e-6)


def test_with_bf16_compute_only_what_the_layers_do_not_cast_is_rounded(tiny_model_dir):
    from echo2cli.learner.rounding import read_at_fp32

    tr = make_trainer(tiny_model_dir)
    names = {id(p): n for n, p in tr.model.named_parameters()}
    every = {names[id(p)] for p in read_at_fp32(tr.model, bf16_compute=False)}
    uncast = {names[id(p)] for p in read_at_fp32(tr.model, bf16_compute=True)}
    assert every == set(names.values())
    assert uncast == {"model.embed_tokens.weight", "model.norm.weight"} | {
        f"model.layers.{i}.{norm}.weight" for i in range(2) for norm in ("input_layernorm", "post_attention_layernorm")
    }


@pytest.mark.parametrize("wire", ["bf16", "fp16"])
def test_a_checkpoint_is_evaluated_as_the_version_published_from_it(tiny_model_dir, tmp_path, wire):
    """`echo2 eval --run` on an engine computing in fp32 takes the checkpoint's weights rounded to the run's wire
    dtype: the policy the steps trained, byte for byte the version published after them, not the fp32 master."""
    from safetensors.torch import load_file

    from echo2cli.broadcast.image import WIRE_DTYPES
    from echo2cli.evaluate import rounded_checkpoint

    tr = make_trainer(tiny_model_dir, bf16=False, wire_dtype=WIRE_DTYPES[wire])
    prompt = [5, 6]
    samples = [Sample(prompt_id=0, sample_idx=i, completion_token_ids=[20 + i], logprobs=[-4.0]) for i in range(2)]
    tr.step([Group(0, 0, prompt, samples, [1.0, 0.0], "w")])
    checkpoint = tmp_path / "run" / "checkpoints" / "step_000001"
    tr.save_checkpoint(checkpoint)
    published = tr.published_weights()
    with rounded_checkpoint(checkpoint, wire) as model_dir:
        rounded = load_file(str(model_dir / "model.safetensors"))
        assert (model_dir / "config.json").is_file()
    assert rounded.keys() == published.keys()
    assert all(torch.equal(rounded[k], published[k]) for k in published)
    assert not all(
        torch.equal(rounded[k].float(), v) for k, v in load_file(str(checkpoint / "model.safetensors")).items()
    )
    assert not model_dir.exists()
    with pytest.raises(ConfigError, match="neither bf16 nor fp16"), rounded_checkpoint(checkpoint, "fp8"):
        pass


@pytest.mark.parametrize("wire", [torch.bfloat16, torch.float16])
def test_a_dithered_master_publishes_version_0_unchanged(tiny_model_dir, wire):
    """`--master-dither` moves the fp32 master inside each weight's rounding interval in the wire dtype: the
    workers' version 0 is byte for byte the one published without it."""
    plain = make_trainer(tiny_model_dir, bf16=False, wire_dtype=wire)
    dithered = make_trainer(tiny_model_dir, bf16=False, dither_seed=0, wire_dtype=wire)
    published, dithered_published = plain.published_weights(), dithered.published_weights()
    assert all(torch.equal(published[k], dithered_published[k]) for k in published)
    masters = zip(plain.model.parameters(), dithered.model.parameters(), strict=True)
    assert not all(torch.equal(p, q) for p, q in masters)


def test_fp16_versions_need_a_learner_computing_in_fp32(tiny_model_dir):
    """bf16 compute would round the layers' weights to bf16 again: not the fp16 policy the workers sample."""
    with pytest.raises(ConfigError, match="--wire-dtype fp16 needs a learner computing in fp32"):
        make_trainer(tiny_model_dir, bf16=True, wire_dtype=torch.float16)
    published = make_trainer(tiny_model_dir, bf16=False, wire_dtype=torch.float16).published_weights()
    assert {t.dtype for t in published.values()} == {torch.float16}
