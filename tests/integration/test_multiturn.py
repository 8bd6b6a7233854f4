"""Multi-turn episodes end to end: a learner on whole poker hands (stepped by the learner: the deal is hidden), a
real worker playing them with vLLM turn by turn, and a hostile client whose transcript carries forged environment
tokens: rejected as `forged_env`, while the same transcript unforged is admitted. Nothing is faked but the hostile
client's answers."""

from __future__ import annotations

import json
import os

import pytest
from procs import finish, spawn, wait_listening

from echo2cli import __version__
from echo2cli.demo import free_port
from echo2cli.metrics import read_metrics
from echo2cli.protocol import JoinRequest, LeaseRequest, RolloutBatch, Sample
from echo2cli.tasks.episodes import Turns, play
from echo2cli.worker.client import LearnerClient
from echo2cli.worker.multiturn import LearnerSteps

pytestmark = pytest.mark.integration

G = 2
STEPS = 2


def transcripts(client, worker_id, turns, lease, forge: bool) -> list[Sample]:
    """G transcripts of each leased hand, answering 'call' every turn, the learner stepping the hands (poker hides
    its deal); one environment token changed if `forge`."""
    eos = sorted(turns.eos_ids)[0]
    answer = turns.tokenizer.encode("ACTION: call", add_special_tokens=False) + [eos]

    class Said:
        token_ids, logprobs, finish_reason = answer, [-0.1] * len(answer), "stop"

    played = play(
        lambda batch, t, n: [Said() for _ in batch],
        LearnerSteps(client, worker_id, lease, G, len(turns.tokenizer)),
        [item.prompt_token_ids for item in lease.prompts for _ in range(G)],
        temperature=1.0,
        max_new_tokens=16,
        max_turns=4,
        context_len=4096,
        transcript_tokens=4096,
    )
    samples = []
    for k, item in enumerate(lease.prompts):
        for i, t in enumerate(played[k * G : (k + 1) * G]):
            ids = list(t.token_ids)
            if forge and 0 in t.policy_mask:
                at = t.policy_mask.index(0) + 5
                ids[at] = (ids[at] + 1) % 1000
            samples.append(
                Sample(
                    prompt_id=item.prompt_id,
                    sample_idx=i,
                    completion_token_ids=ids,
                    logprobs=t.logprobs,
                    policy_mask=t.policy_mask,
                )
            )
    return samples


def hostile_round(client, worker_id, turns, forge: bool):
    resp = client.lease(LeaseRequest(worker_id=worker_id, version=0, max_prompts=1))
    assert resp.status == "ok" and resp.lease is not None, resp
    assert resp.lease.prompts[0].episode is None, "a hand's deal never leaves the learner"
    samples = transcripts(client, worker_id, turns, resp.lease, forge)
    batch = RolloutBatch(worker_id=worker_id, lease_id=resp.lease.lease_id, version=0, samples=samples)
    return client.submit(batch)


@pytest.fixture(scope="module")
def run(tmp_path_factory, plumbing_model):
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("multiturn")
    (out / "run.toml").write_text('[learner]\ntask = "poker_hands"\n[learner.task_options]\nunreadable = "call"\n')
    port = free_port()
    args = ["learner", "--config", str(out / "run.toml"), "--out", str(out), "--steps", str(STEPS)]
    args += ["--prompts-per-step", "2", "-G", str(G), "--max-new-tokens", "16", "-S", "1", "--port", str(port)]
    args += ["--bt-listen", "127.0.0.1:0", "--checkpoint-every", "0", "--token", "t0k3n", "--quiet"]
    args += ["--model", str(plumbing_model)]  # the checks are on transcripts and their replay, not on the play
    learner = spawn(args, out / "learner.log")
    url = f"http://127.0.0.1:{port}"
    wait_listening(learner, out)

    turns = Turns(AutoTokenizer.from_pretrained(plumbing_model))
    client = LearnerClient(url, "t0k3n")
    joined = client.join(JoinRequest(name="mallory", echo2_version=__version__))
    assert joined.max_turns == 4 and joined.transcript_tokens > 4 * 16 and joined.hidden_state
    honest = hostile_round(client, joined.worker_id, turns, forge=False)
    forged = hostile_round(client, joined.worker_id, turns, forge=True)
    hostile = {"honest": honest.model_dump(), "forged": forged.model_dump(), "worker_id": joined.worker_id}
    (out / "hostile.json").write_text(json.dumps(hostile))
    client.leave(joined.worker_id)

    worker = spawn(
        ["worker", "--join", url, "--token", "t0k3n", "--name", "w0", "--work-dir", str(out / "w0")]
        + ["--bt-listen", "127.0.0.1:0", "--prompts-per-lease", "1", "--kv-cache-gib", "0.5"],
        out / "worker.log",
        env={"VLLM_CPU_OMP_THREADS_BIND": str(0 % (os.cpu_count() or 1))},
    )
    finish(learner, [worker], out)
    return out


def test_the_forged_transcript_is_rejected_and_the_honest_one_admitted(run):
    hostile = json.loads((run / "hostile.json").read_text())
    assert hostile["honest"]["accepted"] == G and hostile["honest"]["rejected"] == {}
    assert hostile["forged"]["accepted"] == 0 and hostile["forged"]["rejected"] == {"forged_env": G}
    assert "environment" in hostile["forged"]["detail"]


def test_the_learner_trains_on_hands_the_real_worker_played(run):
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(STEPS))
    last = rows[-1]
    assert {"reward/chips", "reward/turns", "reward/won", "reward/illegal"} <= last.keys()
    assert all(r["train/tokens"] < r["rollout/gen_tokens"] for r in rows if r["reward/turns"] > 1)  # policy only
    mallory = json.loads((run / "hostile.json").read_text())["worker_id"]
    real = [r for r in rows if mallory not in {w for w, _ in r["rollout/worker_versions"]}]
    assert real and any(r["reward/turns"] > 1 for r in real), "the real worker's hands went past one decision"
