import itertools
import random

import pytest
from pokerkit import Card, Deck, StandardHighHand

from echo2cli.errors import ConfigError
from echo2cli.tasks import load_task
from echo2cli.tasks.poker import (
    PokerTask,
    Spot,
    action_ev,
    chen_score,
    hand_strength,
    parse_action,
    showdown_curve,
)


@pytest.fixture(scope="module")
def problems():
    return list(itertools.islice(PokerTask(equity_samples=200).prompts(0), 60))


def facing_a_bet(problems):
    return next(p for p in problems if p.meta["to_call"] > 0 and "raise" in p.meta["legal"])


def river_nuts(to_call: int) -> Spot:
    """A royal flush on the river, hand-built: the hero cannot lose."""
    return Spot(
        stack=200,
        seat="BB",
        street="river",
        hole="As Ks",
        board="Qs Js Ts 2c 3d",
        history="hand-built",
        pot=20 + to_call,
        hero_bet=0,
        opp_bet=to_call,
        hero_stack=190,
        opp_stack=190 - to_call,
        to_call=to_call,
        legal=("fold", "call" if to_call else "check", "raise"),
        min_raise_to=max(2, 2 * to_call),
        max_raise_to=190,
    )


@pytest.mark.parametrize(
    ("completion", "action"),
    [
        ("I fold.\nACTION: fold", "fold"),
        ("action: CHECK", "check"),
        ("ACTION: Call", "call"),
        ("ACTION: raise 40", "raise 40"),
        ("ACTION: Raise to 1,000 chips", "raise 1000"),
        ("ACTION: bet 12", "raise 12"),
        ("**ACTION:** `raise 8`", "raise 8"),
        ("ACTION: all-in", "all-in"),
        ("ACTION: ALLIN!", "all-in"),
        ("ACTION: raise all in", "all-in"),
        ("ACTION: call.\nGood luck!", "call"),
        ("ACTION: fold\nOn second thought...\nACTION: raise 20", "raise 20"),
        ("ACTION: raise 20\nACTION: fold", "fold"),
        ("ACTION: raise", None),
        ("ACTION: raise 20.5", None),
        ("ACTION: shrug", None),
        ("I would call here.", None),
        ("", None),
    ],
)
def test_parse_reads_the_last_action_line_leniently(completion, action):
    assert parse_action(completion) == action


def test_illegal_actions_score_zero(problems):
    task = PokerTask()
    problem = facing_a_bet(problems)
    lo, hi = problem.meta["min_raise_to"], problem.meta["max_raise_to"]
    for completion in (f"ACTION: raise {lo - 1}", f"ACTION: raise {hi + 1}", "ACTION: check"):
        score = task.score(problem, completion)
        assert score.reward == 0.0
        assert score.components == {"format": 1.0, "legal": 0.0, "ev": 0.0}
    assert task.score(problem, "ACTION: dance").components["format"] == 0.0
    assert task.score(problem, f"ACTION: raise {lo}").components["legal"] == 1.0


def test_the_answer_scores_the_maximum_reward(problems):
    task = PokerTask()
    for problem in problems:
        assert task.score(problem, f"ACTION: {problem.answer}").reward == 1.0
        for action in problem.meta["evs"]:
            assert task.score(problem, f"ACTION: {action}").reward <= 1.0


def test_fold_is_legal_and_worst_with_the_nuts():
    task = PokerTask(equity_samples=100)
    problem = task.problem(river_nuts(to_call=10))
    assert problem.meta["equity"] == 1.0
    assert problem.answer == "raise 190"  # the opponent's calls only pay the nuts: shove
    fold = task.score(problem, "ACTION: fold")
    assert fold.components == {"format": 1.0, "legal": 1.0, "ev": 0.0}
    assert fold.reward == pytest.approx(0.1)
    assert task.score(problem, "ACTION: call").reward > fold.reward
    assert task.score(problem, "ACTION: all-in").reward == 1.0


def test_fold_scores_above_illegal_and_below_the_answer(problems):
    task = PokerTask()
    for problem in problems:
        fold = task.score(problem, "ACTION: fold").reward
        assert fold >= 0.1
        if problem.answer != "fold":
            assert fold < 1.0


def test_call_with_nothing_to_call_is_a_check():
    task = PokerTask(equity_samples=50)
    problem = task.problem(river_nuts(to_call=0))
    assert task.score(problem, "ACTION: call") == task.score(problem, "ACTION: check")
    assert task.score(problem, "ACTION: check").components["legal"] == 1.0


def test_same_seed_gives_the_same_problems_and_different_seeds_differ():
    a = list(itertools.islice(PokerTask(equity_samples=50).prompts(3), 15))
    b = list(itertools.islice(PokerTask(equity_samples=50).prompts(3), 15))
    c = list(itertools.islice(PokerTask(equity_samples=50).prompts(4), 15))
    assert a == b
    assert [p.meta for p in a] == [p.meta for p in b]
    assert {p.id for p in a}.isdisjoint({p.id for p in c})


def test_eval_split_is_disjoint_from_training():
    task = PokerTask(equity_samples=10)
    train = {p.id for p in itertools.islice(task.prompts(0, "train"), 300)}
    held_out = {p.id for p in itertools.islice(task.prompts(0, "eval"), 30)}
    assert held_out and not train & held_out


def test_pocket_aces_preflop_have_about_85_percent_equity():
    counts, wins = showdown_curve(Card.clean("AhAd"), (), 2000, random.Random(0))
    assert counts[-1] == 2000
    assert wins[-1] / (2 * 2000) == pytest.approx(0.85, abs=0.05)


def test_the_nuts_on_the_river_never_lose():
    counts, wins = showdown_curve(Card.clean("AsKs"), Card.clean("QsJsTs2c3d"), 300, random.Random(0))
    assert wins[-1] == 2 * counts[-1]


def unopened_pot(**showdowns):
    """What action_ev reads: a pot of 10, nothing bet yet on this street, and the showdown table."""
    return {"pot": 10, "to_call": 0, "hero_bet": 0, "opp_bet": 0} | showdowns


def test_bluffs_lose_and_value_bets_win_under_the_opponent_model():
    hopeless = unopened_pot(equity=0.0, samples=4, curve_counts=(0, 4), curve_wins=(0, 0))
    assert action_ev(hopeless, "check") == 0.0
    # raise to 10 (pot): the opponent needs 10/30 to call, so folds 1/3: 1/3 * 10 - 2/3 * 10
    assert action_ev(hopeless, "raise 10") == pytest.approx(-10 / 3)
    nuts = unopened_pot(equity=1.0, samples=4, curve_counts=(0, 4), curve_wins=(0, 8))
    assert action_ev(nuts, "check") == 10.0
    assert action_ev(nuts, "raise 10") == pytest.approx(10 / 3 + 2 / 3 * 20)


def test_the_opponent_calls_with_its_strongest_hands():
    # two sampled hands: the one the opponent ranks higher beats the hero, the other loses to it
    split = unopened_pot(equity=0.5, samples=2, curve_counts=(0, 1, 2), curve_wins=(0, 0, 2))
    # a pot-sized raise is called by 2/3 of the range: all of the stronger hand, a third of the weaker
    expected = 1 / 3 * 10 + (1 / 3 * 1 * 30 - 4 / 3 * 10) / 2
    assert action_ev(split, "raise 10") == pytest.approx(expected)


def test_fast_hand_strength_matches_pokerkit():
    rng = random.Random(0)
    deck = list(Deck.STANDARD)
    for n in [5, 6, 7] * 100:
        cards = rng.sample(deck, n)
        expected = StandardHighHand.from_game(cards[:2], cards[2:]).entry.index
        assert hand_strength(cards[:2], cards[2:]) == expected


def test_chen_scores_known_hands():
    assert chen_score(Card.clean("AhAd")) == 20
    assert chen_score(Card.clean("AsKs")) == 12
    assert chen_score(Card.clean("2c2d")) == 5
    assert chen_score(Card.clean("7h2c")) == -1.5


def test_spots_are_read_from_a_consistent_pokerkit_state(problems):
    for problem in problems:
        m = problem.meta
        invested = (m["stack"] - m["hero_stack"]) + (m["stack"] - m["opp_stack"])
        assert m["pot"] == invested
        assert m["to_call"] == max(0, m["opp_bet"] - m["hero_bet"])
        assert m["max_raise_to"] == m["hero_stack"] + m["hero_bet"]
    assert {p.meta["street"] for p in problems} == {"preflop", "flop", "turn", "river"}
    assert {p.meta["seat"] for p in problems} == {"BTN", "BB"}


def test_prompts_show_cards_and_legal_actions(problems):
    for problem in problems:
        m = problem.meta
        legal = next(line for line in problem.prompt.splitlines() if line.startswith("Legal actions:"))
        assert "fold" in legal
        assert ("check" in legal) == (m["to_call"] == 0)
        assert (f"call {m['to_call']}" in legal) == (m["to_call"] > 0)
        assert f"raise to {m['min_raise_to']}-{m['max_raise_to']}" in legal
        assert f"Your cards: {m['hole']}" in problem.prompt
        assert f"Pot: {m['pot']} " in problem.prompt
        assert problem.messages[0]["role"] == "system"
        assert "ACTION: raise <total>" in problem.messages[0]["content"]  # the answer format


def test_load_task_builds_the_poker_task_with_options():
    assert load_task("poker").name == "poker"
    task = load_task("poker", {"equity_samples": 100})
    assert next(task.prompts(0)).meta["samples"] == 100
    with pytest.raises(ConfigError, match="equity_samples"):
        load_task("poker", {"equity_samples": 0})
