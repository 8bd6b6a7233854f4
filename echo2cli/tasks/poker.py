"""Heads-up no-limit hold'em decisions: "you hold As Kd on 7h 8h 9c, facing a bet of 4: what do you do?"

Each problem is one decision in a real no-limit hold'em hand played by pokerkit's rules (`NoLimitTexasHoldem`,
two players, blinds 1/2, every amount in chips, both players start with `stack` chips: 200 = 100 big blinds).
The cards come from a seeded `random.Random` and are dealt (and burnt) explicitly, so pokerkit's own
shuffle never matters. A short random prefix of legal actions (checks, calls, bets and raises of a third
of the pot to 1.5 pots, never a fold or an all-in) leads to the decision, on a street chosen uniformly
from preflop, flop, turn and river; the player to act then is the hero. The prompt shows the hero's cards,
the board, the action so far, pot, stacks, the amount to call and the legal actions with the raise range,
all read from pokerkit's state.

Answer: the last `ACTION:` line of the completion (case and markdown ignored): `fold`, `check`, `call`,
`raise N` or `bet N` (N = the total the hero's bet on this street becomes, pokerkit's "raise to"),
`all-in`/`allin` (= raise to the whole stack); a raise without an amount is unreadable. Legal is what
pokerkit allows: `check` facing a bet is illegal, `call` with nothing to call is a check (both are pokerkit's
`check_or_call`), `fold` is always allowed (pokerkit only warns where checking is free), a raise must lie in
pokerkit's [min, max] raise-to range.

Opponent model, under which each action's EV (chips, relative to now: what is already in the pot is
sunk) is computed:
- the opponent's hand is uniform over the cards the hero cannot see; after the decision there is no more
  betting and the hand goes to showdown. Hero equity e (ties count half) is estimated by Monte Carlo over
  `equity_samples` opponent hands and board completions, ranked by pokerkit's `StandardHighHand`;
- fold: 0; check: e * pot; call c: e * (pot + c) - c (pot includes both players' bets);
- raise to r, the hero putting x = r - hero_bet more in and the opponent facing y = r - opp_bet: the opponent
  defends at pot odds. It folds with probability f = y / (pot + x + y), the equity its call needs, and folds
  its weakest hands, as ranked by what it can see (Bill Chen's score preflop, its made hand on the board after;
  a hand's rank stands in for its equity against a random hand). EV = f * pot + (1 - f) * (e_c * (pot + x + y)
  - x), where e_c is the hero's equity against the hands that call. Why not a random fraction folding at the
  minimum defence frequency x / (x + pot): then a bluff breaks even, every raise beats folding, and the
  biggest raise is the answer for every hand with any equity at all.

Reward: an unparseable or illegal action scores 0. A legal one scores 0.9 * ev + 0.1 (the `format` bonus),
where ev = (EV(action) - EV_min) / (EV_max - EV_min) over the legal actions: fold, check or call, and raises
to min, max and a grid of pot fractions, plus the chosen action (1 if all are equal). Components: `format`
(an `ACTION:` line parsed), `legal`, `ev`. `Problem.answer` is the best action of that grid (ties go to
check/call, then fold, then the smallest raise). The equity and the showdown table behind every EV are
computed once, when the problem is made, from a `random.Random` seeded by the problem itself, and kept in
`Problem.meta`, so `score` is cheap and deterministic.

A problem's id is a hash of what the hero sees (starting stack, seat, cards, board, action so far); the eval
split is the problems whose hash falls in bucket 0 of 10, so training never sees one, whatever the seed.
"""

from __future__ import annotations

import hashlib
import random
import re
import warnings
from bisect import bisect_left
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from itertools import combinations, groupby
from math import prod
from typing import Any, NamedTuple

from pokerkit import Automation, Card, Deck, Mode, NoLimitTexasHoldem, RankOrder, StandardHighHand, State

from echo2cli.tasks import Problem, Score, Split, chat

BLINDS = (1, 2)
STREETS = ("preflop", "flop", "turn", "river")
SEATS = ("BB", "BTN")  # pokerkit's heads-up order: player 0 posts the big blind, player 1 the small (button)
RAISE_FRACTIONS = (1 / 3, 1 / 2, 2 / 3, 3 / 4, 1, 3 / 2)  # of the pot after calling: prefix sizes
GRID_FRACTIONS = (1 / 4, 1 / 3, 1 / 2, 2 / 3, 3 / 4, 1, 5 / 4, 3 / 2, 2, 3)  # candidate raises for EV_min/max
FORMAT_BONUS = 0.1

_AUTOMATIONS = (
    Automation.ANTE_POSTING,
    Automation.BET_COLLECTION,
    Automation.BLIND_OR_STRADDLE_POSTING,
    Automation.HOLE_CARDS_SHOWING_OR_MUCKING,
    Automation.HAND_KILLING,
    Automation.CHIPS_PUSHING,
    Automation.CHIPS_PULLING,
)
_DECK = tuple(Deck.STANDARD)
MAX_AMOUNT_DIGITS = 12
_ACTION = re.compile(r"action\s*:[ \t]*([^\n]*)", re.IGNORECASE)
_VERB = re.compile(
    r"(fold|check|call|all[- ]?in|raise|bet)\b(?:\s+(?:to\s+)?(all[- ]?in|\$?\d(?:[\d,]*\d)?(?!\.?\d)))?"
)

# The prompt is kept short: on a 2-core CPU the prompt's prefill is most of an eval's cost (348 tokens
# for the first eval problem with the wordier version this replaced, 175 with this one).
SYSTEM = (
    "Heads-up no-limit hold'em, blinds 1/2, amounts in chips. The opponent's cards are unknown. "
    "Choose the action with the highest expected value and end with one line: `ACTION: fold`, "
    "`ACTION: check`, `ACTION: call`, `ACTION: raise <total>` (what your bet on this street becomes) "
    "or `ACTION: all-in`."
)


def parse_action(completion: str) -> str | None:
    """The action of the last `ACTION:` line: "fold", "check", "call", "raise N" or "all-in"; None if unreadable."""
    found = _ACTION.findall(completion.replace("*", "").replace("`", ""))
    match = _VERB.match(found[-1].strip().lower()) if found else None
    if match is None:
        return None
    verb, amount = match.groups()
    if verb.startswith("all") or (amount or "").startswith("all"):
        return "all-in"
    if verb in ("raise", "bet"):
        digits = (amount or "").lstrip("$").replace(",", "")
        # no stack has 13 digits; and int() refuses strings of more than 4,300 digits with an exception
        return f"raise {int(digits)}" if 0 < len(digits) <= MAX_AMOUNT_DIGITS else None
    return verb


# Hand strength: pokerkit's StandardHighHand lookup, memoised. `from_game` ranks all 21 five-card hands
# of seven cards through Card parsing (~0.6 ms); without a flush only the ranks matter, so the best hand of
# a rank multiset (named by a product of primes) is looked up once.

_LOOKUP = StandardHighHand.lookup
_VALUE = {rank: i + 2 for i, rank in enumerate(RankOrder.STANDARD)}  # deuce = 2 ... ace = 14
_PRIME = dict(zip(RankOrder.STANDARD, (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41), strict=True))


class _Card(NamedTuple):
    prime: int
    suit: str
    card: Card


_CARDS = {card: _Card(_PRIME[card.rank], card.suit, card) for card in _DECK}
_FIVE: dict[tuple[int, bool], int] = {}  # (rank product, flush) of five cards -> pokerkit entry index
_NO_FLUSH: dict[int, int] = {}  # rank product of 5-7 cards without a flush -> entry index of the best five


def _five(cards: tuple[_Card, ...]) -> int:
    a, b, c, d, e = cards
    key = (a.prime * b.prime * c.prime * d.prime * e.prime, a.suit == b.suit == c.suit == d.suit == e.suit)
    if key not in _FIVE:
        _FIVE[key] = _LOOKUP.get_entry([card.card for card in cards]).index
    return _FIVE[key]


def _strength(cards: Sequence[_Card]) -> int:
    suits = [c.suit for c in cards]
    if max(map(suits.count, set(suits))) >= 5:
        return max(map(_five, combinations(cards, 5)))
    key = prod(c.prime for c in cards)
    if key not in _NO_FLUSH:
        _NO_FLUSH[key] = max(map(_five, combinations(cards, 5)))
    return _NO_FLUSH[key]


def hand_strength(hole: Sequence[Card], board: Sequence[Card]) -> int:
    """`StandardHighHand.from_game(hole, board).entry.index` (greater is stronger), 5 to 7 cards in all."""
    return _strength([_CARDS[c] for c in (*hole, *board)])


def chen_score(hole: Sequence[Card]) -> float:
    """Bill Chen's preflop score (unrounded): how the opponent ranks its hands before the flop."""
    high, low = sorted((_VALUE[c.rank] for c in hole), reverse=True)
    score = {14: 10.0, 13: 8.0, 12: 7.0, 11: 6.0}.get(high, high / 2)
    if high == low:
        return max(5.0, 2 * score)
    gap = high - low - 1
    score -= (0, 1, 2, 4, 5)[min(gap, 4)]
    score += 2 if hole[0].suit == hole[1].suit else 0
    score += 1 if gap <= 1 and high < 12 else 0
    return score


def showdown_curve(
    hole: Sequence[Card], board: Sequence[Card], samples: int, rng: random.Random
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Monte Carlo showdowns against random opponent hands and runouts, strongest opponent hand first.

    Returns breakpoints (n_k, w_k): against its n_k strongest sampled hands (as the opponent ranks them,
    seeing only its cards and this board) the hero wins w_k half-pots (a win is 2, a tie 1). Hands the
    opponent ranks equal share one segment, so folding part of a tie takes its average.
    """
    seen = set(hole) | set(board)
    unseen = [_CARDS[c] for c in _DECK if c not in seen]
    mine, shown = [_CARDS[c] for c in hole], [_CARDS[c] for c in board]
    fixed = _strength(mine + shown) if len(board) == 5 else None
    results = []
    for _ in range(samples):
        drawn = rng.sample(unseen, 7 - len(board))
        theirs, full = drawn[:2], shown + drawn[2:]
        hero = fixed if fixed is not None else _strength(mine + full)
        villain = _strength(theirs + full)
        rank = chen_score([c.card for c in theirs]) if not board else _strength(theirs + shown)
        results.append((rank, 2 if hero > villain else int(hero == villain)))
    results.sort(key=lambda r: -r[0])
    counts, wins = [0], [0]
    for _, group in groupby(results, key=lambda r: r[0]):
        halves = [w for _, w in group]
        counts.append(counts[-1] + len(halves))
        wins.append(wins[-1] + sum(halves))
    return tuple(counts), tuple(wins)


def _wins(meta: Mapping[str, Any], called: float) -> float:
    """Hero wins (in pots) against the `called` strongest sampled opponent hands, interpolated."""
    counts, wins = meta["curve_counts"], meta["curve_wins"]
    k = max(1, bisect_left(counts, called))
    share = (called - counts[k - 1]) / (counts[k] - counts[k - 1])
    return (wins[k - 1] + share * (wins[k] - wins[k - 1])) / 2


def action_ev(meta: Mapping[str, Any], action: str) -> float:
    """EV in chips, relative to now, of a legal action ("fold", "check", "call", "raise N") under the opponent model."""
    pot, to_call, equity = meta["pot"], meta["to_call"], meta["equity"]
    if action == "fold":
        ev = 0.0
    elif action in ("check", "call"):
        ev = equity * (pot + to_call) - to_call
    else:
        raise_to = int(action.split()[1])
        x, y = raise_to - meta["hero_bet"], raise_to - meta["opp_bet"]
        fold = y / (pot + x + y)
        called = (1 - fold) * meta["samples"]
        ev = fold * pot + (_wins(meta, called) * (pot + x + y) - called * x) / meta["samples"]
    return round(ev, 6) + 0.0  # + 0.0 turns -0.0 into 0.0


def legal_action(meta: Mapping[str, Any], action: str) -> str | None:
    """The action as played ("call" of nothing is "check", "all-in" a raise), or None if pokerkit forbids it."""
    if action == "call" and meta["to_call"] == 0:
        action = "check"
    if action == "all-in" and "raise" in meta["legal"]:
        action = f"raise {meta['max_raise_to']}"
    kind, _, amount = action.partition(" ")
    if kind != "raise":
        return action if kind in meta["legal"] else None
    ok = "raise" in meta["legal"] and meta["min_raise_to"] <= int(amount) <= meta["max_raise_to"]
    return action if ok else None


def candidate_actions(meta: Mapping[str, Any]) -> list[str]:
    """Legal actions with raises on a grid of pot fractions; the order breaks EV ties (passive first)."""
    actions = [a for a in ("check", "call", "fold") if a in meta["legal"]]
    if "raise" in meta["legal"]:
        lo, hi = meta["min_raise_to"], meta["max_raise_to"]
        base, pot_after_call = meta["opp_bet"], meta["pot"] + meta["to_call"]
        sizes = {lo, hi} | {min(hi, max(lo, base + round(f * pot_after_call))) for f in GRID_FRACTIONS}
        actions += [f"raise {r}" for r in sorted(sizes)]
    return actions


@dataclass(frozen=True)
class Spot:
    """What the hero sees at the decision, read from pokerkit's state."""

    stack: int  # both players' starting stack
    seat: str
    street: str
    hole: str
    board: str
    history: str
    pot: int  # including this street's bets
    hero_bet: int
    opp_bet: int
    hero_stack: int  # behind, not counting this street's bet
    opp_stack: int
    to_call: int
    legal: tuple[str, ...]  # of fold, check, call, raise
    min_raise_to: int | None
    max_raise_to: int | None

    @property
    def digest(self) -> bytes:
        seen = f"{self.stack}|{self.seat}|{self.hole}|{self.board}|{self.history}"
        return hashlib.sha256(seen.encode()).digest()


def _new_state(stack: int) -> State:
    return NoLimitTexasHoldem.create_state(
        _AUTOMATIONS, False, 0, BLINDS, BLINDS[1], (stack, stack), 2, mode=Mode.CASH_GAME
    )


def _deal_pending(state: State, cards: Iterator[Card]) -> None:
    # pokerkit's can_deal_hole/can_burn_card/can_deal_board each re-verify the deck; these properties do not
    while state.hole_dealee_index is not None:
        state.deal_hole((next(cards), next(cards)))
    if state.card_burning_status:
        state.burn_card(next(cards))
    if state.board_dealing_count:
        state.deal_board(tuple(next(cards) for _ in range(state.board_dealing_count)))


def _random_raise(state: State, rng: random.Random) -> int | None:
    """A raise-to of a random fraction of the pot after calling; None where it would be all-in."""
    lo, hi = state.min_completion_betting_or_raising_to_amount, state.max_completion_betting_or_raising_to_amount
    if lo is None or hi is None:
        return None
    to_call = state.checking_or_calling_amount or 0
    raise_to = max(lo, max(state.bets) + round(rng.choice(RAISE_FRACTIONS) * (state.total_pot_amount + to_call)))
    return raise_to if raise_to < hi else None


def _play_prefix(state: State, rng: random.Random, street: int, cards: Iterator[Card]) -> list[tuple[int, str]]:
    """Random legal actions until a player must act on `street`; returns (street, "BTN raises to 6") per action.

    Before `street` a player raises with probability 0.3 (at most twice a street) and otherwise checks or
    calls, so the betting always closes; on `street` the player to act becomes the hero with probability 0.5,
    or else raises (probability 0.5, at most 3 raises) or checks/calls, unless that would close the street.
    """
    history: list[tuple[int, str]] = []
    raises = 0
    while True:
        _deal_pending(state, cards)
        current = state.street_index
        on_street = current == street
        if on_street and rng.random() < 0.5:
            return history
        wants_raise = raises < (3 if on_street else 2) and rng.random() < (0.5 if on_street else 0.3)
        raise_to = _random_raise(state, rng) if wants_raise else None
        seat, to_call = SEATS[state.actor_index], state.checking_or_calling_amount
        if raise_to is not None:
            history.append((current, f"{seat} {'bets' if max(state.bets) == 0 else 'raises to'} {raise_to}"))
            state.complete_bet_or_raise_to(raise_to)
            raises += 1
        elif on_street and len(state.actor_indices) == 1:
            return history  # a check or call would close the street
        else:
            history.append((current, f"{seat} {f'calls {to_call}' if to_call else 'checks'}"))
            state.check_or_call()
        if state.street_index != current:
            raises = 0


def _read_spot(state: State, stack: int, history: list[tuple[int, str]]) -> Spot:
    hero = state.actor_index
    to_call = state.checking_or_calling_amount
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # pokerkit allows folding where checking is free, with a warning
        can_fold = state.can_fold()
    can_act = state.can_check_or_call()
    legal = {
        "fold": can_fold,
        "check": can_act and to_call == 0,
        "call": can_act and to_call > 0,
        "raise": state.can_complete_bet_or_raise_to(),
    }
    streets = [
        f"{STREETS[s].capitalize()}: {', '.join(what for _, what in actions)}."
        for s, actions in groupby(history, key=lambda h: h[0])
    ]
    return Spot(
        stack=stack,
        seat=SEATS[hero],
        street=STREETS[state.street_index],
        hole=" ".join(map(repr, state.hole_cards[hero])),
        board=" ".join(map(repr, state.get_board_cards(0))),
        history=" ".join(streets) or "none (blinds posted)",
        pot=state.total_pot_amount,
        hero_bet=state.bets[hero],
        opp_bet=state.bets[1 - hero],
        hero_stack=state.stacks[hero],
        opp_stack=state.stacks[1 - hero],
        to_call=to_call,
        legal=tuple(a for a, ok in legal.items() if ok),
        min_raise_to=state.min_completion_betting_or_raising_to_amount,
        max_raise_to=state.max_completion_betting_or_raising_to_amount,
    )


def random_spot(rng: random.Random, stack: int) -> Spot:
    """Deal a hand from `rng` and play a random prefix to a decision on a random street."""
    state = _new_state(stack)
    cards = iter(rng.sample(_DECK, 12))  # 2 + 2 hole, then burn + flop, burn + turn, burn + river
    street = rng.randrange(len(STREETS))
    return _read_spot(state, stack, _play_prefix(state, rng, street, cards))


def prompt(spot: Spot) -> str:
    position = (
        "button: acts first preflop, last after" if spot.seat == "BTN" else "big blind: acts last preflop, first after"
    )
    options = [f"call {spot.to_call}" if a == "call" else a for a in spot.legal if a != "raise"]
    if "raise" in spot.legal:
        options.append(f"raise to {spot.min_raise_to}-{spot.max_raise_to} ({spot.max_raise_to} is all-in)")
    return "\n".join(
        [
            f"You are {spot.seat} ({position}), {spot.stack} chips each at the start.",
            f"Your cards: {spot.hole}",
            f"Board: {spot.board or 'none'} ({spot.street})",
            f"Action: {spot.history}",
            f"Pot: {spot.pot} (this street: you {spot.hero_bet}, opponent {spot.opp_bet}). "
            f"Behind: you {spot.hero_stack}, opponent {spot.opp_stack}.",
            f"Legal actions: {', '.join(options)}",
        ]
    )


class PokerTask:
    """Options (`[learner.task_options]`): `equity_samples` Monte Carlo showdowns per problem; `stack` chips
    each player starts with (blinds 1/2, so 200 = 100 big blinds)."""

    name = "poker"
    max_new_tokens = 16  # a suggestion for `echo2 eval`: the answer is one ACTION line ("ACTION: raise 120" is 7)

    def __init__(self, equity_samples: int = 400, stack: int = 200) -> None:
        if equity_samples < 1:
            raise ValueError(f"equity_samples must be at least 1, not {equity_samples}")
        if stack < 10:
            raise ValueError(f"stack must be at least 10 chips (5 big blinds), not {stack}")
        self.equity_samples = equity_samples
        self.stack = stack

    def prompts(self, seed: int, split: Split = "train") -> Iterator[Problem]:
        rng = random.Random(seed)
        while True:
            spot = random_spot(rng, self.stack)
            if (spot.digest[0] % 10 == 0) == (split == "eval"):
                yield self.problem(spot)

    def problem(self, spot: Spot) -> Problem:
        """The problem of a spot: equity and EVs from a Monte Carlo run seeded by the spot itself."""
        digest = spot.digest
        hole, board = Card.clean(spot.hole), Card.clean(spot.board)
        rng = random.Random(int.from_bytes(digest[:8], "big"))
        counts, wins = showdown_curve(hole, board, self.equity_samples, rng)
        meta: dict[str, Any] = asdict(spot) | {
            "samples": self.equity_samples,
            "equity": wins[-1] / (2 * self.equity_samples),
            "curve_counts": counts,
            "curve_wins": wins,
        }
        meta["evs"] = {a: action_ev(meta, a) for a in candidate_actions(meta)}
        answer = max(meta["evs"], key=meta["evs"].__getitem__)
        return Problem(f"poker-{digest.hex()[:16]}", chat(prompt(spot), SYSTEM), answer, meta)

    def score(self, problem: Problem, completion: str) -> Score:
        parsed = parse_action(completion)
        action = legal_action(problem.meta, parsed) if parsed else None
        if action is None:
            return Score(0.0, {"format": float(parsed is not None), "legal": 0.0, "ev": 0.0})
        ev = action_ev(problem.meta, action)
        evs = [*problem.meta["evs"].values(), ev]
        lo, hi = min(evs), max(evs)
        normalised = (ev - lo) / (hi - lo) if hi > lo else 1.0
        reward = (1 - FORMAT_BONUS) * normalised + FORMAT_BONUS
        return Score(reward, {"format": 1.0, "legal": 1.0, "ev": normalised})
