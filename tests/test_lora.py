"""LoRA versions: the trainer trains adapters on a frozen base, exports them and the base, checkpoints them; the
merge a tool uses for full weights equals PEFT's. A tiny randomly initialised Llama (test_trainer.py)."""

import os

import pytest
import torch
from test_trainer import logp_of, make_trainer, tiny_model_dir  # noqa: F401  (a fixture)
from test_worker import joined_worker, lora_learner, publish  # noqa: F401  (a fixture)
from worker_fakes import LORA_LAYERS, FakeNode, lora_adapter

from echo2cli.config import LearnerConfig
from echo2cli.errors import BroadcastError
from echo2cli.layout import VersionKey
from echo2cli.learner.trainer import write_weights
from echo2cli.learner.types import Group
from echo2cli.lora import (
    HEADER_BYTES,
    HEADER_BYTES_PER_TENSOR,
    adapter_dir,
    check_adapter,
    lora_spec,
    max_adapter_bytes,
    merge,
    merged_weights,
    vllm_rank,
)
from echo2cli.protocol import LoraSpec, Sample
from echo2cli.worker.loop import Stats
from echo2cli.worker.versions import Pending, Via

SPEC = LoraSpec(rank=4, alpha=8, targets=["q_proj", "v_proj"])


def rewarded_step(tr) -> dict:
    prompt, good, bad = [5, 6], [20, 21], [30, 31]
    samples = [
        Sample(prompt_id=0, sample_idx=i, completion_token_ids=c, logprobs=logp_of(tr, prompt, c).tolist())
        for i, c in enumerate([good, bad, good, bad])
    ]
    return tr.step([Group(0, 0, prompt, samples, [1.0, 0.0, 1.0, 0.0], "w")])


def test_lora_trains_the_adapters_alone_and_a_version_is_only_their_tensors(tiny_model_dir):  # noqa: F811
    tr = make_trainer(tiny_model_dir, lora=SPEC)
    base_before = tr.published_base_weights()
    before = logp_of(tr, [5, 6], [20, 21]).sum()
    rewarded_step(tr)
    assert logp_of(tr, [5, 6], [20, 21]).sum() > before
    base_after = tr.published_base_weights()
    assert base_after.keys() == base_before.keys() and all(
        torch.equal(base_after[k], base_before[k]) for k in base_after
    )
    plain = make_trainer(tiny_model_dir).published_weights()
    assert plain is not None and base_after.keys() == plain.keys()  # named as in the model without adapters
    version = tr.published_weights()
    assert version is not None and len(version) == 2 * 2 * 2  # A and B, of q and v, in each of 2 layers
    assert all(".lora_A." in k or ".lora_B." in k for k in version)
    assert all(v.dtype == torch.bfloat16 for v in version.values())


def test_the_merged_version_scores_like_the_trained_adapters(tiny_model_dir):  # noqa: F811
    tr = make_trainer(tiny_model_dir, lora=SPEC, lr=0.1)
    rewarded_step(tr)
    version, base = tr.published_weights(), tr.published_base_weights()
    assert version is not None
    merged = merge({k: v.float() for k, v in base.items()}, {k: v.float() for k, v in version.items()}, SPEC)
    full = make_trainer(tiny_model_dir)
    full.model.load_state_dict(merged, strict=False)  # a tied lm_head is not in the file
    with tr.peft.disable_adapter():
        assert not torch.allclose(logp_of(tr, [5, 6], [20, 21]), logp_of(full, [5, 6], [20, 21]), atol=1e-4)
    # the adapters were rounded to bf16 on the way out; the trainer's are fp32
    assert torch.allclose(logp_of(tr, [5, 6], [20, 21]), logp_of(full, [5, 6], [20, 21]), atol=2e-2)


def test_merge_refuses_an_adapter_that_fits_no_layer_or_lacks_its_pair():
    base = {"model.layers.0.self_attn.q_proj.weight": torch.zeros(4, 4)}
    a = torch.ones(2, 4)
    with pytest.raises(ValueError, match="adapts no layer"):
        merge(base, {"base_model.model.model.layers.9.self_attn.q_proj.lora_A.weight": a}, SPEC)
    with pytest.raises(ValueError, match="without its pair"):
        merge(base, {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": a}, SPEC)
    b = torch.ones(4, 2)
    merged = merge(
        base,
        {
            "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": a,
            "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": b,
        },
        SPEC,
    )
    assert torch.equal(merged["model.layers.0.self_attn.q_proj.weight"], torch.full((4, 4), 2.0 * 2))  # 8/4 * 2


def test_a_lora_checkpoint_resumes_the_adapters_and_their_optimizer(tiny_model_dir, tmp_path):  # noqa: F811
    tr = make_trainer(tiny_model_dir, lora=SPEC)
    rewarded_step(tr)
    tr.save_checkpoint(tmp_path)
    assert (tmp_path / "adapter_model.safetensors").is_file() and not (tmp_path / "model.safetensors").exists()
    again = make_trainer(tiny_model_dir, lora=SPEC)
    again.load_checkpoint(tmp_path)
    a, b = tr.published_weights(), again.published_weights()
    assert a is not None and b is not None and all(torch.equal(a[k], b[k]) for k in a)
    assert again.opt.state_dict()["state"].keys() == tr.opt.state_dict()["state"].keys()
    other = make_trainer(tiny_model_dir, lora=SPEC.model_copy(update={"targets": ["q_proj"]}))
    with pytest.raises(ValueError, match="do not fit"):
        other.load_checkpoint(tmp_path)
    full = make_trainer(tiny_model_dir)
    with pytest.raises(OSError):  # the learner turns it into "checkpoint ... does not load"
        full.load_checkpoint(tmp_path)


def test_a_published_adapter_version_merges_into_its_base(tiny_model_dir, tmp_path):  # noqa: F811
    from safetensors.torch import save_file

    tr = make_trainer(tiny_model_dir, lora=SPEC, lr=0.1)
    rewarded_step(tr)
    version, base = tr.published_weights(), tr.published_base_weights()
    assert version is not None
    (tmp_path / "v000000").mkdir()
    (tmp_path / "v000003").mkdir()
    save_file(base, str(tmp_path / "v000000" / "model.safetensors"))
    save_file(version, str(tmp_path / "v000003" / "model.safetensors"))
    adapter_dir(tmp_path / "v000003", SPEC)
    merged = merged_weights(tmp_path / "v000003", tmp_path / "v000000" / "model.safetensors")
    assert torch.equal(
        merged["model.layers.1.self_attn.v_proj.weight"],
        merge(base, version, SPEC)["model.layers.1.self_attn.v_proj.weight"],
    )
    with pytest.raises(FileNotFoundError, match="is gone"):
        merged_weights(tmp_path / "v000003", tmp_path / "nowhere.safetensors")


def test_lora_options():
    assert lora_spec(0, 0, "q_proj") is None
    assert lora_spec(16, 0, " q_proj, v_proj ,") == LoraSpec(rank=16, alpha=32, targets=["q_proj", "v_proj"])
    assert [vllm_rank(r) for r in (1, 2, 16, 17, 300)] == [1, 8, 16, 32, 320]
    with pytest.raises(ValueError, match="one process"):
        LearnerConfig(lora_rank=16, nproc_per_node=2)
    with pytest.raises(ValueError, match="names no layer"):
        LearnerConfig(lora_rank=16, lora_targets=" , ")
    with pytest.raises(ValueError):
        LoraSpec(rank=4, alpha=8, targets=["../x"])  # a learner names layers, not paths


def test_the_adapter_size_bound_is_the_trainers_adapters_plus_the_header_allowance(tiny_model_dir, tmp_path):  # noqa: F811
    tr = make_trainer(tiny_model_dir, lora=SPEC)
    version, base = tr.published_weights(), tr.published_base_weights()
    assert version is not None
    write_weights(version, tmp_path / "adapters.safetensors")  # as the learner publishes them
    write_weights(base, tmp_path / "base.safetensors")
    check_adapter(tmp_path / "adapters.safetensors", tmp_path / "base.safetensors", SPEC)
    bound = max_adapter_bytes({k: tuple(v.shape) for k, v in base.items()}, SPEC)
    data = sum(t.numel() * t.element_size() for t in version.values())
    assert bound - data == HEADER_BYTES + sum(len(k) + HEADER_BYTES_PER_TENSOR for k in version)  # r (in + out) 2 B
    assert (tmp_path / "adapters.safetensors").stat().st_size <= bound
    assert max_adapter_bytes({k: tuple(v.shape) for k, v in base.items()}, SPEC.model_copy(update={"rank": 8})) > bound


def test_an_adapter_version_larger_than_its_spec_allows_is_refused_before_a_byte_is_fetched(tmp_path, lora_learner):  # noqa: F811
    limit = max_adapter_bytes(LORA_LAYERS, lora_learner.lora)
    publish(lora_learner, 1, delta=False, adapter=True, content=os.urandom(limit + 1))
    node = FakeNode(lora_learner.published.root)
    worker = joined_worker(tmp_path, lora_learner, node)
    try:
        with pytest.raises(
            BroadcastError, match=f"version 1 is {limit + 1} bytes of LoRA adapters; .* at most {limit}"
        ):
            worker._start(worker.join_info)  # the engine starts on the base, then version 1 is announced
        assert node.fetched == [0]
    finally:
        worker.stop.set()


def test_an_adapter_delta_is_refused_before_a_byte_is_fetched_and_a_rebuilt_one_is_checked(tmp_path, lora_learner):  # noqa: F811
    publish(lora_learner, 1, delta=False, adapter=True, content=lora_adapter(4))
    node = FakeNode(lora_learner.published.root)
    worker = joined_worker(tmp_path, lora_learner, node, lora_load="adapter")
    worker._start(worker.join_info)
    try:
        worker._work_once(Stats())  # version 1's adapters, whole, checked and loaded
        assert worker.engine.adapters[-1][0] == 1
        # the same size as version 1's adapters, so a delta against them; vLLM would load this lora_A of 8 x 4
        publish(lora_learner, 2, delta=True, adapter=True, content=lora_adapter(4, a_shape=(8, 4)))
        with pytest.raises(BroadcastError, match="version 2 is LoRA adapters announced as a delta"):
            worker._work_once(Stats())
        assert 2 not in node.fetched and worker.engine.adapters[-1][0] == 1
        # had one got through, its rebuilt file would meet the same check as a whole one
        key = VersionKey(2, delta=True)
        node.fetch(key, b"", worker.store.root)
        node.poll()
        with pytest.raises(BroadcastError, match="the adapters of version 2 do not fit the base model"):
            worker.store._verify(Pending(lora_learner.published.policies[2], Via.DELTA))
    finally:
        worker.stop.set()
