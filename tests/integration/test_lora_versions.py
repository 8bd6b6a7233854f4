"""LoRA versions round-trip: learner -> swarm -> vLLM, and greedy outputs equal the learner's merged model.

A real learner (`--lora-rank 16`) and a real worker train 3 steps. Version 0 is the base's full weights, every
later version the adapters alone (each under 2 % of version 0's bytes); the worker starts its engine on the base
and loads the adapters of each version it swaps in (load events say so). Then the adapters the worker received
and prepared, loaded into a vLLM engine on the base the worker received, generate greedily exactly what the
learner's published adapters merged into its base (PEFT's merge_and_unload, transformers' generate) do, with the
same log-probs; with the adapters off, the log-probs differ, so the adapters were applied. Both sides run in fp32
so that no bf16 rounding tells them apart. Adapters that do not fit the base, which vLLM would take, are refused.
"""

from __future__ import annotations

import json

import pytest
import torch
from procs import finish, spawn, wait_listening

from echo2cli.demo import free_port
from echo2cli.layout import VersionKey
from echo2cli.lora import check_adapter
from echo2cli.metrics import read_metrics
from echo2cli.models import model_dir_with_weights, prepare_default_model
from echo2cli.protocol import LoraSpec
from echo2cli.tasks import encode_chat
from echo2cli.tasks.arithmetic import ArithmeticTask

pytestmark = pytest.mark.integration

STEPS, NEW_TOKENS = 3, 12
SPEC = LoraSpec(rank=16, alpha=32, targets=["q_proj", "k_proj", "v_proj", "o_proj"])


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("lora")
    port = free_port()
    learner = spawn(
        [
            "learner",
            *("--out", str(out), "--steps", str(STEPS), "--prompts-per-step", "2", "-G", "4"),
            *("--max-new-tokens", "8", "-S", "1", "--port", str(port), "--bt-listen", "127.0.0.1:0"),
            # a large step, so that 3 of them move the adapters far enough to tell them from the base
            *("--lora-rank", "16", "--lr", "5e-3", "--checkpoint-every", "0", "--quiet"),
        ],
        out / "learner.log",
    )
    wait_listening(learner, out)
    worker = spawn(
        [
            "worker",
            *("--join", f"http://127.0.0.1:{port}", "--name", "w0", "--work-dir", str(out / "w0")),
            *("--bt-listen", "127.0.0.1:0", "--prompts-per-lease", "1", "--kv-cache-gib", "0.5"),
        ],
        out / "w0.log",
    )
    finish(learner, [worker], out)
    return out  # removed with the module's other directories (tests/conftest.py)


def loads(out) -> list[dict]:
    return [e for e in read_metrics(out / "w0" / "events.jsonl") if e.get("event") == "loaded"]


def test_version_0_is_the_base_and_later_versions_are_adapters_under_2_percent(run):
    versions = run / "versions"
    full = VersionKey(0).path(versions).stat().st_size
    adapters = [VersionKey(v).path(versions) for v in range(1, STEPS + 1) if VersionKey(v).path(versions).is_file()]
    assert adapters and all(p.stat().st_size <= 0.02 * full for p in adapters)
    events = loads(run)
    assert events[0]["version"] == 0 and not events[0]["adapter"] and events[0]["size_bytes"] == full
    later = [e for e in events if e["version"] > 0]
    assert later and all(e["adapter"] and e["digest_verified"] for e in later)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == STEPS


def test_the_adapters_generate_in_vllm_exactly_what_the_learners_merged_model_does(run, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from echo2cli.worker.engine import Engine

    version = loads(run)[-1]["version"]
    assert version > 0
    worker_versions = run / "w0" / "versions"
    received = VersionKey(version).dir(worker_versions)  # the worker's adapter directory, as it loaded it
    base = prepare_default_model()
    engine_dir = model_dir_with_weights(tmp_path / "engine", base, VersionKey(0).path(worker_versions))
    tok = AutoTokenizer.from_pretrained(base)
    problems = ArithmeticTask().prompts(seed=3, split="train")
    prompts = [encode_chat(tok, next(problems).messages) for _ in range(4)]

    learner_base = model_dir_with_weights(tmp_path / "learner", base, VersionKey(0).path(run / "versions"))
    model = AutoModelForCausalLM.from_pretrained(learner_base, dtype=torch.float32)
    merged = PeftModel.from_pretrained(model, VersionKey(version).dir(run / "versions")).merge_and_unload().eval()
    expected, expected_logps = [], []
    with torch.no_grad():
        for p in prompts:
            out = merged.generate(
                torch.tensor([p]),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                output_scores=True,
                return_dict_in_generate=True,
            )
            ids = out.sequences[0, len(p) :].tolist()
            expected.append(ids)
            expected_logps.append(
                [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.scores, ids, strict=True)]
            )

    engine = Engine(engine_dir, kv_cache_gib=0.5, max_model_len=512, dtype="float32", lora=SPEC, adapters_kept=3)
    try:
        assert engine.load_adapter(version, received) < 30
        got = [g[0] for g in engine.generate(prompts, n=1, temperature=0.0, max_new_tokens=NEW_TOKENS)]
        assert [c.token_ids for c in got] == expected
        diffs = [
            abs(a - b) for c, e in zip(got, expected_logps, strict=True) for a, b in zip(c.logprobs, e, strict=True)
        ]
        engine.adapter = None  # the base alone: the first token of each prompt scores differently
        plain = [g[0] for g in engine.generate(prompts, n=1, temperature=0.0, max_new_tokens=1)]
        off = [abs(c.logprobs[0] - p.logprobs[0]) for c, p in zip(got, plain, strict=True)]
        print(f"|vLLM LoRA - merged| max {max(diffs):.2e}; adapters off: max {max(off):.2e}")
        assert max(diffs) < 1e-3 < max(off)

        check_adapter(received / "adapter_model.safetensors", VersionKey(0).path(worker_versions), SPEC)
    finally:
        engine.close()


def test_adapters_that_do_not_fit_the_base_are_caught_before_vllm_takes_them(run, tmp_path):
    """vLLM loads a 16 x 7 lora_A without a word (and generates with it): the worker's check refuses it."""
    from safetensors.torch import load_file, save_file

    worker_versions = run / "w0" / "versions"
    received = VersionKey(loads(run)[-1]["version"]).dir(worker_versions)
    tensors = load_file(str(received / "adapter_model.safetensors"))
    name = next(k for k in tensors if k.endswith("lora_A.weight"))
    tensors[name] = torch.zeros(16, 7, dtype=tensors[name].dtype)
    save_file(tensors, str(bad := tmp_path / "bad.safetensors"))
    with pytest.raises(ValueError, match=r"is \[16, 7\], not \[16, 576\]"):
        check_adapter(bad, VersionKey(0).path(worker_versions), SPEC)
