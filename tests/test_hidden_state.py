"""Hidden information stays off workers: poker hands are stepped by the learner (`learner/episode_host.py`), a
worker that knows everything the API gave it cannot name the deal, and transcripts played that way replay as
played. Also: a replay that fails is a rejection, and a truncated hand is scored as a fold.

The learner runs in process (FastAPI's TestClient behind the real `LearnerClient`) with the default model's
tokenizer; the worker side is the real `EpisodePlayer` machinery with a scripted generator in place of vLLM.
"""

from __future__ import annotations

import functools
import itertools
import json
import random
from collections import Counter
from dataclasses import dataclass

import pytest
from fastapi.testclient import TestClient

from echo2cli import __version__
from echo2cli.errors import LeaseLost
from echo2cli.learner.coordinator import Coordinator
from echo2cli.learner.episode_host import episode_host
from echo2cli.learner.server import build_app
from echo2cli.models import prepare_default_model
from echo2cli.protocol import (
    EpisodeAction,
    JoinRequest,
    LeaseRequest,
    PolicyInfo,
    RolloutBatch,
    Sample,
    StepRequest,
)
from echo2cli.tasks import encode_chat
from echo2cli.tasks.episodes import LocalSteps, Turns, play, score_transcript
from echo2cli.tasks.poker_hands import Hand, PokerHandsTask, parse_spec
from echo2cli.worker.client import LearnerClient
from echo2cli.worker.multiturn import LearnerSteps

TOKEN = "s3cret"
G = 2
TURN_TOKENS = 16


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(prepare_default_model())


@pytest.fixture(scope="module")
def turns(tok):
    return Turns(tok)


def make_learner(tmp_path, tok, task, B=4):
    """A coordinator on `task` with the real tokenizer, and a client that calls its app in process."""
    coord = Coordinator(
        task,
        encode_prompt=lambda messages: encode_chat(tok, messages),
        decode=lambda ids: tok.decode(ids, skip_special_tokens=True),
        group_size=G,
        staleness=1,
        prompts_per_step=B,
        max_new_tokens=4 * TURN_TOKENS + 3 * 512,
        vocab_size=len(tok),
        lease_timeout_s=60.0,
        heartbeat_s=2.0,
        seed=0,
        turns=(4, TURN_TOKENS),
        replay=Turns(tok),
    )
    coord.publish(
        PolicyInfo(version=0, info_hash="ab" * 20, torrent_b64="", digest="cd" * 32, size_bytes=1, published_at=0)
    )
    (tmp_path / "config.json").write_text("{}")
    app = build_app(
        coord,
        run_id="r",
        join_info=dict(
            task=task.name,
            group_size=G,
            max_new_tokens=TURN_TOKENS,
            temperature=1.0,
            staleness=1,
            heartbeat_s=2.0,
            model_files=["config.json"],
            max_turns=4,
            transcript_tokens=coord.max_new_tokens,
            hidden_state=coord.prompts.hidden,
        ),
        model_dir=tmp_path,
        model_files=["config.json"],
        token=TOKEN,
        status_extra=dict,
        target_steps=3,
        episodes=(host := episode_host(coord, prepare_default_model())),
    )

    def new_client() -> LearnerClient:
        client = LearnerClient("http://testserver", TOKEN)
        client.http = TestClient(app, base_url="http://testserver", headers=dict(client.http.headers))
        return client

    coord.new_client = new_client  # another worker's own client
    coord.episode_host = host  # what the learner holds of each episode
    return coord, new_client()


@dataclass
class Said:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str = "stop"


def scripted(turns, answers, rng=None):
    """Answers each live episode with a text of `answers` (in turn, or at random with `rng`), closed by EOS."""
    said = itertools.cycle(answers)
    eos = sorted(turns.eos_ids)[0]

    def generate(prompts, temperature, max_new_tokens):
        out = []
        for _ in prompts:
            text = rng.choice(answers) if rng else next(said)
            ids = turns.tokenizer.encode(text, add_special_tokens=False)[: max_new_tokens - 1] + [eos]
            out.append(Said(ids, [-0.5] * len(ids)))
        return out

    return generate


class Recorder:
    """Every answer body the worker's client received, as text: what a hostile worker knows."""

    def __init__(self, client):
        self.bodies: list[str] = []
        send = client.http.request

        def request(*args, **kwargs):
            response = send(*args, **kwargs)
            self.bodies.append(response.text)
            return response

        client.http.request = request


def play_lease(client, joined, turns, answers, rng=None):
    lease = client.lease(LeaseRequest(worker_id=joined.worker_id, version=0, max_prompts=4)).lease
    assert lease is not None
    steps = LearnerSteps(client, joined.worker_id, lease, G, len(turns.tokenizer))
    prompts = [item.prompt_token_ids for item in lease.prompts for _ in range(G)]
    played = play(
        scripted(turns, answers, rng),
        steps,
        prompts,
        temperature=1.0,
        max_new_tokens=TURN_TOKENS,
        max_turns=4,
        context_len=8192,
        transcript_tokens=joined.transcript_tokens,
    )
    return lease, played


def samples_of(lease, played):
    return [
        Sample(
            prompt_id=item.prompt_id,
            sample_idx=j,
            completion_token_ids=t.token_ids,
            logprobs=t.logprobs,
            policy_mask=t.policy_mask,
        )
        for k, item in enumerate(lease.prompts)
        for j, t in enumerate(played[k * G : (k + 1) * G])
    ]


def test_leases_carry_no_deal_and_hands_stepped_by_the_learner_replay_as_played(tmp_path, tok, turns):
    coord, client = make_learner(tmp_path, tok, PokerHandsTask(unreadable="call"))
    joined = client.join(JoinRequest(name="w", echo2_version=__version__))
    assert joined.hidden_state and coord.prompts.hidden
    lease, played = play_lease(client, joined, turns, ["ACTION: call", "ACTION: check"])
    assert all(item.episode is None for item in lease.prompts)
    assert all(t.done for t in played) and any(t.policy_mask.count(0) for t in played), "hands go past one decision"
    for k, item in enumerate(lease.prompts):  # the learner's own replay from its secret spec: as played
        spec = coord.prompts.problems[item.prompt_id].meta["episode"]
        for t in played[k * G : (k + 1) * G]:
            score = score_transcript(PokerHandsTask(unreadable="call"), turns, spec, t.token_ids, t.policy_mask)
            assert score.components["done"] == 1.0 and "forged" not in score.components
    result = client.submit(
        RolloutBatch(worker_id=joined.worker_id, lease_id=lease.lease_id, version=0, samples=samples_of(lease, played))
    )
    assert result.accepted == len(lease.prompts) * G and result.rejected == {}


def test_steps_out_of_turn_for_others_leases_or_past_g_are_refused_and_a_retry_gets_the_same_answer(
    tmp_path, tok, turns
):
    coord, client = make_learner(tmp_path, tok, PokerHandsTask(unreadable="call"))
    other = coord.new_client()
    a = client.join(JoinRequest(name="a", echo2_version=__version__))
    b = other.join(JoinRequest(name="b", echo2_version=__version__))
    lease = client.lease(LeaseRequest(worker_id=a.worker_id, version=0, max_prompts=1)).lease
    call = turns.tokenizer.encode("ACTION: call", add_special_tokens=False)
    pid = lease.prompts[0].prompt_id

    def step(worker, turn, sample_idx=0, lease_id=lease.lease_id, ids=call):
        action = EpisodeAction(prompt_id=pid, sample_idx=sample_idx, turn=turn, token_ids=ids)
        by = client if worker is a else other
        return by.step_episodes(StepRequest(worker_id=worker.worker_id, lease_id=lease_id, actions=[action]))

    first = step(a, 0)
    assert step(a, 0) == first  # the same action again: the same answer, nothing stepped twice
    for bad in (lambda: step(a, 0, ids=call + call), lambda: step(a, 5), lambda: step(a, 0, sample_idx=G)):
        with pytest.raises(Exception, match="refused|answered 4|turn|sample_idx"):
            bad()
    with pytest.raises(Exception, match="not in a live lease"):
        step(b, 0, lease_id=lease.lease_id)  # another worker's lease
    # two actions for one episode in one request (copies, or two different moves): refused, nothing stepped
    fold = turns.tokenizer.encode("ACTION: fold", add_special_tokens=False)
    for second in (call, fold):
        actions = [EpisodeAction(prompt_id=pid, sample_idx=1, turn=0, token_ids=ids) for ids in (call, second)]
        with pytest.raises(Exception, match="two actions for episode"):
            client.step_episodes(StepRequest(worker_id=a.worker_id, lease_id=lease.lease_id, actions=actions))
    assert (lease.lease_id, pid, 1) not in coord.episode_host.episodes
    coord.leave(a.worker_id)  # its lease goes back: the episode is gone
    coord.join("c", 0.0)
    assert coord.leases.leases == {}


def test_a_worker_knowing_everything_the_api_gave_it_names_the_deal_no_better_than_chance(tmp_path, tok, turns):
    """The adversary reads every answer the worker got (join, leases, every step) and tries what can name a deal:
    any spec, number or string in them as the hand's seed, and the task's public stream under small run seeds
    with the prompt id. A candidate deal is kept if it matches the worker's own hole cards and seat; its opponent
    cards and board are the guess (else a random guess)."""
    coord, client = make_learner(tmp_path, tok, PokerHandsTask(unreadable="call"), B=8)
    recorder = Recorder(client)
    joined = client.join(JoinRequest(name="eve", echo2_version=__version__))
    rng = random.Random(0)
    hits = Counter()
    hands = 0
    for _ in range(3):
        lease, played = play_lease(client, joined, turns, ["ACTION: call", "ACTION: check", "ACTION: fold"], rng)
        client.submit(
            RolloutBatch(
                worker_id=joined.worker_id, lease_id=lease.lease_id, version=0, samples=samples_of(lease, played)
            )
        )
        for item in lease.prompts:
            truth = dealt(coord.prompts.problems[item.prompt_id].meta["episode"])
            guess = adversary_guess(recorder.bodies, item, truth["mine"], rng)
            hits["opponent"] += guess["opponent"] == truth["opponent"]
            hits["board"] += guess["board"] == truth["board"]
            hands += 1
    # chance: 1/1225 for two hole cards, less than 1e-9 for the rest of the deal; 12 hands
    assert hands == 12 and hits["opponent"] <= 1 and hits["board"] == 0, hits


@functools.cache
def dealt(spec: str) -> dict:
    """The hero's cards and seat, the opponent's cards, and the rest of the deck as dealt (board and burns) of the
    deal `spec` names."""
    hand = Hand(spec)
    rest = frozenset(map(str, list(hand.cards)[4:]))
    hand = Hand(spec)
    hand.reset()
    mine = (frozenset(map(str, hand.state.hole_cards[hand.hero])), hand.hero)
    return {"mine": mine, "opponent": frozenset(map(str, hand.state.hole_cards[1 - hand.hero])), "board": rest}


def adversary_guess(bodies: list[str], item, mine, rng) -> dict:
    candidates: set[str] = set()
    for body in bodies:
        for value in _leaves(json.loads(body) if body.startswith(("{", "[")) else body):
            text = str(value)
            if text.count(":") == 2:
                candidates.add(text)  # a spec as such
            elif text.isdigit():
                candidates.update(f"{stack}:{text}:{how}" for stack in (200, 100, 1000) for how in ("call", "fold"))
    for seed in range(4):  # the run's --seed is public, or guessable
        stream = PokerHandsTask(unreadable="call").prompts(seed)
        candidates.add(next(itertools.islice(stream, item.prompt_id, None)).meta["episode"])
    for spec in sorted(candidates):
        try:
            parse_spec(spec)
        except ValueError:
            continue
        if dealt(spec)["mine"] == mine:
            return dealt(spec)
    deck = [r + s for r in "23456789TJQKA" for s in "cdhs"]
    return {"opponent": frozenset(rng.sample(deck, 2)), "board": frozenset(rng.sample(deck, 8))}


def _leaves(value):
    if isinstance(value, dict):
        for v in value.values():
            yield from _leaves(v)
    elif isinstance(value, list):
        if value and all(isinstance(v, int) for v in value):
            yield from value[:3]  # a token list: its first few numbers are enough to try
        else:
            for v in value:
                yield from _leaves(v)
    elif value is not None:
        yield value


def test_a_replay_that_raises_rejects_the_group_and_counts_towards_cut_off(tmp_path, tok, turns):
    coord, client = make_learner(tmp_path, tok, RaisingHands(unreadable="call"))
    joined = client.join(JoinRequest(name="w", echo2_version=__version__))
    lease, played = play_lease(client, joined, turns, ["ACTION: boom"])
    result = client.submit(
        RolloutBatch(worker_id=joined.worker_id, lease_id=lease.lease_id, version=0, samples=samples_of(lease, played))
    )
    assert result.accepted == 0 and result.rejected == {"replay_failed": len(lease.prompts) * G}
    assert result.invalid == len(lease.prompts) * G  # untrusted: it counts towards cutting the worker off
    assert coord.fleet.workers[joined.worker_id].bad_streak == 1


class RaisingHands(PokerHandsTask):
    """Poker hands whose environment raises on the action 'boom' (as `int()` raised on a 4,400-digit raise)."""

    name = "raising_hands"

    def episode(self, spec):
        hand = super().episode(spec)
        step = hand.step

        def raising(action):
            if "boom" in action:
                raise ValueError("the environment fails on this action")
            return step(action)

        hand.step = raising
        return hand


def test_a_4400_digit_raise_is_an_unreadable_answer_not_an_exception():
    from echo2cli.tasks.poker import parse_action

    assert parse_action("ACTION: raise to " + "9" * 4400) is None
    assert parse_action("ACTION: raise to 40") == "raise 40"


def test_a_truncated_hand_is_scored_as_a_fold_not_as_losing_the_whole_stack(turns):
    task = PokerHandsTask(unreadable="call")
    problems = list(itertools.islice(task.prompts(0), 12))
    prompts = [encode_chat(turns.tokenizer, p.messages) for p in problems]
    episodes = [task.episode(p.meta["episode"]) for p in problems]
    played = play(
        scripted(turns, ["ACTION: call"]),
        LocalSteps(turns, episodes),
        prompts,
        temperature=1.0,
        max_new_tokens=TURN_TOKENS,
        max_turns=1,  # every hand that needs a second decision is cut after its first
        context_len=8192,
        transcript_tokens=8192,
    )
    cut = [(p, t) for p, t in zip(problems, played, strict=True) if not t.done]
    assert cut, "some hands go past one decision"
    for problem, t in cut:
        score = score_transcript(task, turns, problem.meta["episode"], t.token_ids, t.policy_mask)
        committed = -score.components["chips"]
        assert score.components["truncated"] == 1.0 and 0 < committed < task.stack  # only what was put in
        assert score.reward == 0.5 - committed / (2 * task.stack) > 0.0


def test_a_lease_the_learner_no_longer_holds_ends_play_with_lease_lost(tmp_path, tok, turns):
    coord, client = make_learner(tmp_path, tok, PokerHandsTask(unreadable="call"))
    joined = client.join(JoinRequest(name="w", echo2_version=__version__))
    lease = client.lease(LeaseRequest(worker_id=joined.worker_id, version=0, max_prompts=1)).lease
    coord.leases.leases[lease.lease_id].deadline = 0.0
    coord.expire_leases()
    steps = LearnerSteps(client, joined.worker_id, lease, G, len(tok))
    with pytest.raises(LeaseLost, match="not in a live lease"):
        steps(0, [(0, turns.tokenizer.encode("ACTION: call", add_special_tokens=False))])


def test_a_resumed_learner_deals_the_same_hands_under_the_same_prompt_ids_and_a_new_run_deals_others():
    def coordinator():
        return Coordinator(
            PokerHandsTask(unreadable="call"),
            encode_prompt=lambda messages: [ord(c) % 100 for c in messages[-1]["content"][:8]],
            decode=lambda ids: "",
            group_size=G,
            staleness=1,
            prompts_per_step=4,
            max_new_tokens=4 * TURN_TOKENS + 3 * 512,
            vocab_size=1000,
            lease_timeout_s=60.0,
            heartbeat_s=2.0,
            seed=0,
            turns=(4, TURN_TOKENS),
        )

    first = coordinator()
    for _ in range(5):
        first.prompts.draw()
    state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint holds it
    resumed, other = coordinator(), coordinator()
    resumed.load_state(state)
    other.prompts.draw()
    specs = [p.meta["episode"] for p in first.prompts.problems.values()]
    assert [p.meta["episode"] for p in resumed.prompts.problems.values()] == specs
    assert other.prompts.problems[0].meta["episode"] != specs[0]  # the same --seed, another secret
