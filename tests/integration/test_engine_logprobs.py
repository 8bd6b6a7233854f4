"""The worker's engine and the learner's trainer agree on what a sampled token's log-prob is.

Real vLLM (CPU; the session's shared engine, `integration_fixtures.engine`) on the default model exported in bf16
exactly as the learner publishes a version, and the real Trainer on the fp32 weights it was exported from. For the
same tokens, the behaviour log-probs the engine returns and the trainer's must agree at T = 1 and at T = 0.7 (both
are log softmax(z / T)); a trainer that ignored T (echo2 before this test) is far off at T = 0.7. Also: a prompt
longer than the engine's context comes back without completions, and the others in the same call are generated. And
after a hot swap to weights whose tied embedding changed, the engine scores with the new LM head, as a worker's
engine must after every version it swaps in."""

from __future__ import annotations

import math

import pytest
import torch

from echo2cli.learner.trainer import Trainer
from echo2cli.learner.types import Group
from echo2cli.models import prepare_default_model
from echo2cli.protocol import Sample
from echo2cli.tasks import encode_chat
from echo2cli.tasks.arithmetic import ArithmeticTask

pytestmark = pytest.mark.integration

PROMPTS, N, NEW_TOKENS = 12, 4, 16


@pytest.fixture(scope="module")
def setup(tmp_path_factory, engine):
    """The trainer on the default model, and the session's engine on its weights exported in bf16 as published."""
    from transformers import AutoTokenizer

    base = prepare_default_model()
    trainer = Trainer(base, lr=1e-6, clip_eps=0.2, is_cap=3.0, kl_coef=0.0, max_grad_norm=1.0, micro_batch=16)
    export = tmp_path_factory.mktemp("v0")
    trainer.export_weights(export / "weights" / "model.safetensors")  # bf16, as published
    tok = AutoTokenizer.from_pretrained(base)
    problems = ArithmeticTask().prompts(seed=1, split="train")
    prompts = [encode_chat(tok, next(problems).messages) for _ in range(PROMPTS)]
    engine.reload(export / "weights")
    return trainer, engine, prompts


def trainer_logps(trainer: Trainer, prompts, groups, temperature: float) -> tuple[list[float], list[float]]:
    """(trainer log-probs, engine log-probs) of every sampled token, flattened."""
    trainer.temperature = temperature
    rows = [(p, c.token_ids, c.logprobs) for p, g in zip(prompts, groups, strict=True) for c in g]
    pack = trainer._pack(rows)
    with torch.no_grad():
        logp = trainer._token_logp(trainer.model, pack)
    where = pack.mask.bool()
    return logp[where].tolist(), pack.behaviour[where].tolist()


def mismatch(ours: list[float], theirs: list[float]) -> dict[str, float]:
    d = [a - b for a, b in zip(ours, theirs, strict=True)]
    return {
        "mean_abs": sum(map(abs, d)) / len(d),
        "max_abs": max(map(abs, d)),
        "kl_behaviour": sum(math.exp(-x) + x - 1 for x in d) / len(d),
        "tokens": len(d),
    }


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_engine_and_trainer_log_probs_agree_at_the_sampling_temperature(setup, temperature):
    trainer, engine, prompts = setup
    groups = engine.generate(prompts, n=N, temperature=temperature, max_new_tokens=NEW_TOKENS)
    same = mismatch(*trainer_logps(trainer, prompts, groups, temperature))
    ignored = mismatch(*trainer_logps(trainer, prompts, groups, 1.0))  # a trainer blind to T
    print(f"T={temperature}: {same}; trainer at T=1: {ignored}")
    # measured here (bf16 compute on both sides): mean |diff| 0.04, max 0.36 nats, kl_behaviour 0.002 at T = 1
    # and at T = 0.7; the trainer at T = 1 on the T = 0.7 samples: kl_behaviour 0.077, max 3.3 nats
    assert same["mean_abs"] < 0.1 and same["max_abs"] < 2.0 and same["kl_behaviour"] < 0.01
    if temperature != 1.0:
        assert ignored["kl_behaviour"] > 10 * same["kl_behaviour"]


def test_a_prompt_longer_than_the_engines_context_gets_no_completions_and_the_rest_do(setup):
    _, engine, prompts = setup
    too_long = prompts[0] * (engine.max_model_len // len(prompts[0]) + 1)
    groups = engine.generate([prompts[1], too_long, prompts[2]], n=2, temperature=1.0, max_new_tokens=4)
    assert [len(g) for g in groups] == [2, 0, 2]


def test_the_trainer_scores_a_group_at_the_sampling_temperature(setup):
    """`Trainer.step` goes through the same `_token_logp`: its importance weights are ~1 on fresh samples."""
    trainer, engine, prompts = setup
    groups = engine.generate(prompts[:2], n=N, temperature=0.7, max_new_tokens=NEW_TOKENS)
    trainer.temperature = 0.7
    batch = [
        Group(
            i,
            0,
            p,
            [
                Sample(prompt_id=i, sample_idx=j, completion_token_ids=c.token_ids, logprobs=c.logprobs)
                for j, c in enumerate(g)
            ],
            [float(j % 2) for j in range(N)],
            "w",
        )
        for i, (p, g) in enumerate(zip(prompts[:2], groups, strict=True))
    ]
    metrics = trainer.step(batch)
    assert abs(metrics["train/is_weight_mean"] - 1.0) < 0.02 and metrics["train/kl_behaviour"] < 0.01


def test_a_hot_swapped_engine_scores_with_the_new_tied_head(setup, tmp_path):
    """On CPU, vLLM's reload re-packs the layers it loads, and the tied LM head loads nothing of its own: without
    `repack_unloaded_heads` the engine kept the first weights' head (docs/BENCHMARKS.md)."""
    trainer, engine, prompts = setup
    embedding = trainer.model.get_input_embeddings().weight  # tied: the LM head's weight too
    before = embedding.detach().clone()
    try:
        with torch.no_grad():
            embedding.mul_(1.5)  # logits 1.5x sharper on the trainer's side; a stale head misses it
            embedding.copy_(embedding.to(torch.bfloat16))  # as published, so the wire's rounding is not measured
        trainer.export_weights(tmp_path / "v1" / "model.safetensors")
        engine.reload(tmp_path / "v1")
        groups = engine.generate(prompts, n=N, temperature=1.0, max_new_tokens=NEW_TOKENS)
        swapped = mismatch(*trainer_logps(trainer, prompts, groups, 1.0))
    finally:
        with torch.no_grad():
            embedding.copy_(before)
        trainer.export_weights(tmp_path / "v0" / "model.safetensors")
        engine.reload(tmp_path / "v0")
    print(f"after the swap: {swapped}")
    # measured (fp32 compute on both sides, no AVX512-BF16): mean |diff| 6e-6, max 8e-5 nats; without the repack
    # 0.57 and 6.1 nats, kl_behaviour 2.6
    assert swapped["mean_abs"] < 0.1 and swapped["max_abs"] < 2.0 and swapped["kl_behaviour"] < 0.01
