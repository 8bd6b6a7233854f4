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
    assert (
        eight.states == pytest.approx(one.states / 8)
        and one.states == 16 * QWEN3_8B.params() + 4 * QWEN3_8B.root_params()
    )
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


def test_eager_layers_save_more_than_compiled_ones_as_measured_on_an_h200():
    """Qwen3-1.7B shape, one process, 16,384-token micro-batches of 64 x (256 + 1,024): the H200 measured peaks of
    94.6 GiB eager and 72.9 GiB compiled (docs/BENCHMARKS.md); the plan is within 10 % of both."""
    from echo2cli.plan.memory import GiB

    qwen3_1_7b = Shape(vocab=151936, hidden=2048, intermediate=6144, layers=28, heads=16, kv_heads=8, head_dim=128,
                       tied=True)  # fmt: skip
    eager = learner_memory(qwen3_1_7b, 1, 16384, 16384, checkpointing=False, compiled=False).total / GiB
    compiled = learner_memory(qwen3_1_7b, 1, 16384, 16384, checkpointing=False, compiled=True).total / GiB
    assert eager == pytest.approx(94.6, rel=0.1) and compiled == pytest.approx(72.9, rel=0.1)


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_largest_micro_batch_is_the_last_multiple_of_1024_tokens_that_fits(compiled, checkpointing):
    from echo2cli.plan.memory import RESERVE, GiB, largest_micro_batch

    device = 139.8 * GiB
    tokens = largest_micro_batch(QWEN3_4B, 1, device, checkpointing, compiled)
    assert tokens > 0 and tokens % 1024 == 0
    fits = learner_memory(QWEN3_4B, 1, tokens, 2048, checkpointing, compiled).total
    too_many = learner_memory(QWEN3_4B, 1, tokens + 1024, 2048, checkpointing, compiled).total
    assert fits <= RESERVE * device < too_many
    assert largest_micro_batch(QWEN3_8B, 1, device, checkpointing, compiled) == 0  # its states alone do not fit


def test_the_suggested_setting_drops_checkpointing_where_enough_fits_without_it():
    """Qwen3-4B on one H200 compiled: no checkpointing (measured 38.6 % MFU at 8,192 tokens against 32.6 % with
    checkpointing at 32,768); eager layers fit too few tokens, so checkpointing; on 80 GiB checkpointing either way."""
    compiled = plan(QWEN3_4B, device_gib=139.8, compiled=True)["learner"]
    assert (
        compiled["suggested"]
        == f"--max-tokens-per-micro-batch {compiled['largest_micro_batch_tokens']['without_checkpointing']}"
    )
    eager = plan(QWEN3_4B, device_gib=139.8, micro_batch_tokens=1024)["learner"]["suggested"]
    assert eager.endswith("--activation-checkpointing (with --compile more fits)")
    assert (
        "--activation-checkpointing"
        in plan(QWEN3_4B, micro_batch_tokens=1024, checkpointing=True)["learner"]["suggested"]
    )
    with pytest.raises(ConfigError):
        plan(QWEN3_8B, device_gib=139.8)
