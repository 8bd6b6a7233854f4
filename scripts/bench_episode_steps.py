"""What stepping hidden-state environments on the learner costs per turn: poker hands played through the learner's
`/v1/episodes/step` over real HTTP, against the same hands stepped locally (the baseline, measured in this run).

    .venv/bin/python scripts/bench_episode_steps.py [--leases 6] [--prompts 8] [-G 4] [--json]

A real learner app (uvicorn on loopback, the real coordinator and episode host, the default model's tokenizer)
leases `--prompts` hands; a worker plays each G times through the real `LearnerClient` and `LearnerSteps`, one
request per turn for all the lease's live episodes. The policy is scripted (check or call, sometimes a raise or a
fold), so the figures are the environment's and the round trip's alone, not the engine's. The local baseline steps
the same hands with the same actions (`LocalSteps`). Reported per turn of a lease: the median wall time of each,
the added milliseconds, and the learner's own time inside the host.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

from echo2cli import __version__
from echo2cli.learner.coordinator import Coordinator
from echo2cli.learner.episode_host import episode_host
from echo2cli.learner.server import bind_socket, build_app, serving
from echo2cli.models import prepare_default_model
from echo2cli.protocol import JoinRequest, LeaseRequest, PolicyInfo
from echo2cli.tasks import encode_chat
from echo2cli.tasks.episodes import LocalSteps, Turns, play
from echo2cli.tasks.poker_hands import PokerHandsTask
from echo2cli.worker.client import LearnerClient
from echo2cli.worker.multiturn import LearnerSteps

TURN_TOKENS = 16
ANSWERS = ["ACTION: call"] * 6 + ["ACTION: check"] * 3 + ["ACTION: raise 12", "ACTION: fold"]


class Timed:
    """Wraps a Steps callable: wall seconds of each call."""

    def __init__(self, steps):
        self.steps, self.seconds = steps, []

    def __call__(self, turn, actions):
        t0 = time.perf_counter()
        out = self.steps(turn, actions)
        self.seconds.append(time.perf_counter() - t0)
        return out


def scripted(tok, seed: int):
    """The same actions for the same (lease, turn) in both runs: a generator seeded per lease."""
    rng = random.Random(seed)
    eos = tok.eos_token_id

    class Said:
        def __init__(self, ids):
            self.token_ids, self.logprobs, self.finish_reason = ids, [-0.5] * len(ids), "stop"

    def generate(prompts, temperature, max_new_tokens):
        return [Said(tok.encode(rng.choice(ANSWERS), add_special_tokens=False) + [eos]) for _ in prompts]

    return generate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--leases", type=int, default=6)
    ap.add_argument("--prompts", type=int, default=8, help="hands per lease")
    ap.add_argument("-G", type=int, default=4, help="plays of each hand")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    model_dir = prepare_default_model()
    tok = AutoTokenizer.from_pretrained(model_dir)
    turns = Turns(tok)
    task = PokerHandsTask(unreadable="call")
    coord = Coordinator(
        task,
        encode_prompt=lambda messages: encode_chat(tok, messages),
        decode=lambda ids: tok.decode(ids, skip_special_tokens=True),
        group_size=args.G,
        staleness=args.leases,  # room for every lease at once: nothing here trains
        prompts_per_step=args.prompts,
        max_new_tokens=4 * TURN_TOKENS + 3 * 512,
        vocab_size=len(tok),
        lease_timeout_s=600.0,
        heartbeat_s=60.0,
        seed=0,
        turns=(4, TURN_TOKENS),
    )
    coord.publish(
        PolicyInfo(version=0, info_hash="0" * 40, torrent_b64="", digest="0" * 64, size_bytes=1, published_at=0)
    )
    host = episode_host(coord, model_dir)
    assert host is not None
    learner_s: list[float] = []
    step = host.step

    def timed_step(*a):
        t0 = time.perf_counter()
        try:
            return step(*a)
        finally:
            learner_s.append(time.perf_counter() - t0)

    host.step = timed_step  # type: ignore[method-assign]
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text("{}")
        join_info = dict(
            task=task.name,
            group_size=args.G,
            max_new_tokens=TURN_TOKENS,
            temperature=1.0,
            staleness=args.leases,
            heartbeat_s=60.0,
            model_files=["config.json"],
            max_turns=4,
            transcript_tokens=coord.max_new_tokens,
            hidden_state=True,
        )
        app = build_app(
            coord,
            run_id="bench",
            join_info=join_info,
            model_dir=Path(tmp),
            model_files=["config.json"],
            token="t",
            status_extra=dict,
            target_steps=1,
            episodes=host,
        )
        sock = bind_socket("127.0.0.1", 0)
        with serving(app, sock):
            client = LearnerClient(f"http://127.0.0.1:{sock.getsockname()[1]}", "t")
            remote, local = [], []
            for k in range(args.leases):  # a worker each: one holds one lease at a time
                joined = client.join(JoinRequest(name=f"bench{k}", echo2_version=__version__))
                lease = client.lease(LeaseRequest(worker_id=joined.worker_id, version=0, max_prompts=args.prompts))
                assert lease.lease is not None, lease
                prompts = [item.prompt_token_ids for item in lease.lease.prompts for _ in range(args.G)]
                limits = dict(max_new_tokens=TURN_TOKENS, max_turns=4, context_len=8192, transcript_tokens=8192)
                over_http = Timed(LearnerSteps(client, joined.worker_id, lease.lease, args.G, len(tok)))
                play(scripted(tok, k), over_http, prompts, temperature=1.0, **limits)
                specs = [coord.prompts.problems[i.prompt_id].meta["episode"] for i in lease.lease.prompts]
                here = Timed(LocalSteps(turns, [task.episode(s) for s in specs for _ in range(args.G)]))
                play(scripted(tok, k), here, prompts, temperature=1.0, **limits)
                remote += over_http.seconds
                local += here.seconds
            client.close()
    ms = 1000.0
    out = {
        "episodes_per_lease": args.prompts * args.G,
        "turns_measured": len(remote),
        "local_ms_per_turn": statistics.median(local) * ms,
        "learner_ms_per_turn": statistics.median(remote) * ms,
        "learner_host_ms_per_turn": statistics.median(learner_s) * ms,
        "added_ms_per_turn": (statistics.median(remote) - statistics.median(local)) * ms,
        "ratio": statistics.median(remote) / statistics.median(local),
    }
    if args.json:
        print(json.dumps(out))
        return
    print(
        f"{out['turns_measured']} turns of {out['episodes_per_lease']} episodes each: stepped locally "
        f"{out['local_ms_per_turn']:.1f} ms, by the learner over HTTP {out['learner_ms_per_turn']:.1f} ms "
        f"(of which in the learner's host {out['learner_host_ms_per_turn']:.1f} ms): +{out['added_ms_per_turn']:.1f} "
        f"ms per turn, {out['ratio']:.2f}x the local baseline"
    )


if __name__ == "__main__":
    main()
