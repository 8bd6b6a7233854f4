"""The memory plan: parameter counts of known shapes, what sharding and checkpointing save, and one-line refusals."""

import pytest

from echo2cli.errors import ConfigError
from echo2cli.plan.memory import Shape, learner_memory, memory_plan

QWEN3_8B = Shape(
    vocab=151936, hidden=4096, intermediate=12288, layers=36, heads=32, kv_heads=8, head_dim=128, tied=False
)
QWEN3_4B = Shape(vocab=151936, hidden=2560, intermediate=9728, layers=36, heads=32, kv_heads=8, head_dim=128, tied=True)
SMOLLM2_135M = {
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "tie_word_embeddings": True,
}


def plan(shape: Shape, **kw) -> dict:
    args = dict(
        ranks=1,
        device_gib=80.0,
        micro_batch_tokens=4096,
        completion_tokens=2048,
        checkpointing=False,
        rollout_gib=80.0,
        utilization=0.9,
        tensor_parallel=1,
        context=4096,
    )
    return memory_plan(shape, **(args | kw))


def test_parameter_counts_of_known_models():
    assert Shape.from_config(SMOLLM2_135M).params() == pytest.approx(134.5e6, rel=1e-3)
    assert QWEN3_4B.params() == pytest.approx(4.02e9, rel=1e-2)
    assert QWEN3_8B.params() == pytest.approx(8.19e9, rel=1e-2)


def test_sharding_divides_the_states_and_checkpointing_cuts_activations():
    one = learner_memory(QWEN3_8B, 1, 8192, 4096, checkpointing=False)
    eight = learner_memory(QWEN3_8B, 8, 8192, 4096, checkpointing=False)
    assert eight.states == pytest.approx(one.states / 8) and one.states == 16 * QWEN3_8B.params()
    assert eight.gathered > 0 == one.gathered  # whole root and two layers at a time, on ranks that shard
    checkpointed = learner_memory(QWEN3_8B, 8, 8192, 4096, checkpointing=True)
    assert checkpointed.activations < eight.activations / 5
    assert checkpointed.logits == eight.logits == 20 * QWEN3_8B.vocab * 2048  # the head runs 2048 tokens at a time


def test_an_8b_learner_does_not_fit_one_80_gib_gpu_but_fits_eight_with_checkpointing():
    with pytest.raises(ConfigError, match=r"needs 1\d\d\.\d GiB per rank of 1 .* more ranks"):
        plan(QWEN3_8B)
    report = plan(QWEN3_8B, ranks=8, checkpointing=True)
    assert report["learner"]["per_rank_gib"]["total"] < 80


def test_a_rollout_gpu_without_room_for_one_sequence_is_refused_in_one_line():
    report = plan(QWEN3_4B, ranks=8, context=32768)
    kv = report["rollout"]["kv_mib_per_sequence"]
    assert kv == 2 * 36 * 8 * 128 * 2 * 32768 / (1 << 20)  # K and V, bf16, every layer
    assert report["rollout"]["sequences_at_full_context"] >= 1
    with pytest.raises(ConfigError, match="less than one 32768-token sequence") as err:
        plan(QWEN3_8B, ranks=8, checkpointing=True, rollout_gib=24.0, utilization=0.7, context=32768)
    assert "\n" not in str(err.value)
    assert plan(QWEN3_8B, ranks=8, checkpointing=True, rollout_gib=24.0, tensor_parallel=2, context=32768)


def test_a_config_without_a_shape_is_one_line():
    with pytest.raises(ConfigError, match="lacks a decoder shape field"):
        Shape.from_config({"vocab_size": 10})


def test_the_plan_chunks_the_head_as_the_trainer_does():
    from echo2cli.learner.trainer import LOGIT_CHUNK
    from echo2cli.plan import memory

    assert memory.LOGIT_CHUNK == LOGIT_CHUNK
