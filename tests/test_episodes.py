"""Multi-turn episodes: the chat template's turn boundary, play against a scripted generator (pure logic), the
learner's replay (honest transcripts score as played; forged environment tokens, extra turns and bad masks do
not), poker hands by the documented opponent, and admission of masks (the trainer's side: tests/test_trainer.py)."""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

import pytest

from echo2cli.learner.admission import Admission
from echo2cli.models import prepare_default_model
from echo2cli.protocol import Sample
from echo2cli.tasks import encode_chat, load_task
from echo2cli.tasks.episodes import FORGED, LocalSteps, Turns, mask_problem, play, score_transcript, spans
from echo2cli.tasks.poker_hands import Hand, PokerHandsTask, parse_spec, percentile
from echo2cli.tasks.scoring import safe_score


@pytest.fixture(scope="module")
def turns():
    from transformers import AutoTokenizer

    return Turns(AutoTokenizer.from_pretrained(prepare_default_model()))


@dataclass
class Said:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str = "stop"


def scripted(turns, answers):
    """A generator that answers each live episode with the next text of `answers` (cycled), closed by EOS."""
    said = itertools.cycle(answers)
    eos = sorted(turns.eos_ids)[0]

    def generate(prompts, temperature, max_new_tokens):
        out = []
        for _ in prompts:
            ids = turns.tokenizer.encode(next(said), add_special_tokens=False)[: max_new_tokens - 1] + [eos]
            out.append(Said(ids, [-0.5] * len(ids)))
        return out

    return generate


def play_hands(turns, answers, n=6, unreadable="call", **limits):
    task = PokerHandsTask(unreadable=unreadable)
    problems = list(itertools.islice(task.prompts(0), n))
    prompts = [encode_chat(turns.tokenizer, p.messages) for p in problems]
    kwargs = dict(max_new_tokens=16, max_turns=4, context_len=4096, transcript_tokens=4096) | limits
    played = play(
        scripted(turns, answers),
        LocalSteps(turns, [task.episode(p.meta["episode"]) for p in problems]),
        prompts,
        temperature=1.0,
        **kwargs,
    )
    return task, problems, prompts, played


def test_the_turn_boundary_is_the_templates_next_user_message(turns):
    policy = turns.tokenizer.encode("ACTION: call", add_special_tokens=False)
    closed = turns.env_tokens("Board: 7h", policy + sorted(turns.eos_ids))
    open_ = turns.env_tokens("Board: 7h", policy)
    text = turns.tokenizer.decode(closed)
    assert text == "\n<|im_start|>user\nBoard: 7h<|im_end|>\n<|im_start|>assistant\n"
    assert turns.tokenizer.decode(open_) == "<|im_end|>" + text  # a turn cut off by the length cap is closed


def test_hands_are_played_turn_by_turn_and_the_replay_scores_them_as_played(turns):
    task, problems, _, played = play_hands(turns, ["ACTION: call", "ACTION: check"])
    assert all(t.done for t in played) and max(t.policy_mask.count(1) for t in played) > 0
    multi = [t for t in played if len([s for s in spans(t.policy_mask) if s[2]]) > 1]
    assert multi, "calling down reaches later streets"
    for problem, t in zip(problems, played, strict=True):
        assert len(t.token_ids) == len(t.logprobs) == len(t.policy_mask)
        assert all(lp == 0.0 for lp, m in zip(t.logprobs, t.policy_mask, strict=True) if not m)
        replayed = Hand(problem.meta["episode"])
        replayed.reset()
        score = score_transcript(task, turns, problem.meta["episode"], t.token_ids, t.policy_mask)
        assert FORGED not in score.components and score.components["done"] == 1.0
        assert score.reward == 0.5 + score.components["chips"] / 400


def test_forged_environment_tokens_extra_turns_and_bad_masks_are_caught(turns):
    task, problems, _, played = play_hands(turns, ["ACTION: call"])
    t, spec = next((t, p.meta["episode"]) for t, p in zip(played, problems, strict=True) if 0 in t.policy_mask)
    env_at = t.policy_mask.index(0)
    forged = list(t.token_ids)
    forged[env_at + 5] = turns.tokenizer.encode("A", add_special_tokens=False)[0]  # a different card, say
    assert score_transcript(task, turns, spec, forged, t.policy_mask).components == {FORGED: 1.0}
    longer = t.token_ids + [5, 6]  # an observation and another turn after the hand ended
    assert score_transcript(task, turns, spec, longer, t.policy_mask + [0, 1]).components == {FORGED: 1.0}
    assert score_transcript(task, turns, spec, t.token_ids, [0] + t.policy_mask[1:]).components == {FORGED: 1.0}
    honest = score_transcript(task, turns, spec, t.token_ids, t.policy_mask)
    assert safe_score(task, problems[0], (t.token_ids, t.policy_mask), turns).reward >= 0.0
    assert FORGED not in honest.components


def test_play_stops_at_max_turns_and_at_the_transcript_cap(turns):
    _, _, _, played = play_hands(turns, ["ACTION: call"], max_turns=2)
    assert all(len([s for s in spans(t.policy_mask) if s[2]]) <= 2 for t in played)
    assert any(t.finish_reason == "max_turns" for t in played)
    _, _, _, capped = play_hands(turns, ["ACTION: call"], transcript_tokens=100)
    assert all(len(t.token_ids) <= 100 for t in capped) and any(t.finish_reason == "context" for t in capped)


def test_mask_problems():
    assert mask_problem([1, 1, 0, 1], 4, max_turns=4, max_new_tokens=8) == ""
    assert "differ in length" in mask_problem([1], 2, 4, 8)
    assert "other than 0 and 1" in mask_problem([1, 2], 2, 4, 8)
    assert "starts and ends" in mask_problem([1, 0], 2, 4, 8)
    assert "more than the task's 1" in mask_problem([1, 0, 1], 3, 1, 8)
    assert "more than max_new_tokens 2" in mask_problem([1, 1, 1], 3, 4, 2)


def test_admission_wants_a_mask_exactly_for_multi_turn_runs():
    def admission(turns):
        return Admission(
            batch_prompts=1,
            group_size=1,
            staleness=1,
            max_new_tokens=64,
            vocab_size=100,
            requeue=lambda ids: None,
            counters=__import__("collections").Counter(),
            turns=turns,
        )

    plain = Sample(prompt_id=0, sample_idx=0, completion_token_ids=[1, 2], logprobs=[-1.0, -1.0])
    masked = plain.model_copy(update={"policy_mask": [1, 1]})
    assert admission(None).invalid_reason([plain]) == ""
    assert "multi-turn" in admission(None).invalid_reason([masked])
    assert "multi-turn" in admission((4, 8)).invalid_reason([plain])
    assert admission((4, 8)).invalid_reason([masked]) == ""


def test_the_opponent_defends_at_pot_odds_and_the_hand_conserves_chips():
    from pokerkit import Card

    assert percentile(tuple(Card.parse("AsAh")), ()) > 0.99 > 0.1 > percentile(tuple(Card.parse("7c2d")), ())
    rng = random.Random(3)
    for problem in itertools.islice(PokerHandsTask().prompts(1), 40):
        hand = Hand(problem.meta["episode"])
        hand.reset()
        while True:
            step = hand.step(rng.choice(["ACTION: call", "ACTION: raise 20", "ACTION: all-in", "nonsense"]))
            if step.done:
                break
        assert sum(hand.state.stacks) == 2 * hand.stack and -200 <= step.info["chips"] <= 200
        assert 0.0 <= step.reward <= 1.0


def test_specs_from_the_network_are_checked():
    assert parse_spec("200:7:fold") == (200, 7, "fold")
    for bad in ("200:7", "5:7:fold", "200:-1:fold", "200:7:raise", "x" * 5000):
        with pytest.raises(ValueError):
            parse_spec(bad)
    assert load_task("poker_hands", {"unreadable": "call"}).unreadable == "call"


def test_a_transcript_is_truncated_by_its_last_turn_alone():
    from echo2cli.learner.records import last_turn

    sample = Sample(prompt_id=0, sample_idx=0, completion_token_ids=list(range(9)), logprobs=[-1.0] * 9)
    assert last_turn(sample) == 9
    assert last_turn(sample.model_copy(update={"policy_mask": [1, 1, 1, 0, 0, 0, 0, 1, 1]})) == 2
