"""Heads-up no-limit hold'em as whole hands: a multi-turn environment (`tasks/episodes.py`).

One episode is one hand by pokerkit's rules (blinds 1/2, both players start with `stack` chips), dealt from a
`random.Random` seeded by the episode's spec ('STACK:SEED:UNREADABLE'). Every decision of the hero is a turn:
the observation is the same text the one-decision `poker` task shows (cards, board, the action so far, pot,
stacks, legal actions) and the answer is read the same way (the last `ACTION:` line). An unreadable or illegal
answer folds the hand, or with `unreadable = "call"` checks or calls (a gentler start for a model that has not
learnt the format yet: its hands then run to the river).

The opponent is the one the `poker` task documents, now acting at its own turns: it never bets or raises;
with nothing to call it checks; facing a bet it calls unless its hand is among the weakest fraction
y / (pot + y) of the hands it could hold (the equity a call needs; y = the amount to call, pot = everything in
the middle), ranked by what it sees: Bill Chen's score before the flop, its made hand's strength after. So it
defends at pot odds and folds its worst holdings, and a hand reaches showdown when neither player folds.

Reward: the chips the hero won in the hand, as 0.5 + chips / (2 * stack), in [0, 1] (an affine map of chips:
GRPO's group-normalised advantages are the same as with raw chips). Components: `chips` (won, negative when
lost), `won` (1 if chips > 0), `illegal` (1 if an answer folded the hand by being unreadable or illegal).

The hero sits on the button or in the big blind, half the hands each; at most one hero decision per street
(the opponent never re-opens the betting), so `max_turns` = 4. Problem ids hash the spec; the eval split is the
hands whose hash falls in bucket 0 of 10.
"""

from __future__ import annotations

import hashlib
import random
import warnings
from collections.abc import Iterator
from functools import lru_cache
from itertools import combinations
from typing import Any

from pokerkit import Card, State

from echo2cli.tasks import Problem, Split, chat
from echo2cli.tasks.episodes import Step
from echo2cli.tasks.poker import (
    _DECK,
    SEATS,
    SYSTEM,
    _deal_pending,
    _new_state,
    _read_spot,
    chen_score,
    hand_strength,
    legal_action,
    parse_action,
    prompt,
)

MAX_STACK = 100_000


@lru_cache(maxsize=1)
def _chen_table() -> list[float]:
    """Chen scores of all 1326 starting hands, sorted: an opponent hand's preflop percentile."""
    return sorted(chen_score(list(pair)) for pair in combinations(_DECK, 2))


def percentile(hole: tuple[Card, ...], board: tuple[Card, ...]) -> float:
    """The share of the hands the opponent could hold that rank below `hole`, seeing `board` (ties: half)."""
    if not board:
        table, mine = _chen_table(), chen_score(list(hole))
        below = sum(1 for s in table if s < mine)
        equal = sum(1 for s in table if s == mine)
        return (below + equal / 2) / len(table)
    unseen = [c for c in _DECK if c not in board]
    mine = hand_strength(hole, board)
    ranks = [hand_strength(pair, board) for pair in combinations(unseen, 2)]
    below = sum(1 for r in ranks if r < mine)
    equal = sum(1 for r in ranks if r == mine)
    return (below + equal / 2) / len(ranks)


UNREADABLE = ("fold", "call")


def parse_spec(spec: str) -> tuple[int, int, str]:
    """'STACK:SEED:UNREADABLE' -> (stack, seed, unreadable); ValueError for anything else (it comes over the
    network)."""
    parts = str(spec)[:96].split(":")
    ok = len(parts) == 3 and parts[0].isdigit() and parts[1].isdigit() and parts[2] in UNREADABLE
    if not ok or not 10 <= int(parts[0]) <= MAX_STACK:
        raise ValueError(f"a poker hand's spec is 'STACK:SEED:fold|call', 10 <= STACK <= {MAX_STACK}: not {spec!r:.80}")
    return int(parts[0]), int(parts[1]), parts[2]


class Hand:
    """One hand against the documented opponent; `reset` deals, `step` plays the hero's action."""

    def __init__(self, spec: str) -> None:
        self.stack, seed, self.unreadable = parse_spec(spec)
        rng = random.Random(seed)
        self.hero = rng.randrange(2)  # 0 = big blind, 1 = button (pokerkit's heads-up order)
        self.cards = iter(rng.sample(_DECK, 12))  # 2 + 2 hole, then burn + flop, burn + turn, burn + river
        self.state: State = _new_state(self.stack)
        self.history: list[tuple[int, str]] = []
        self.illegal = 0.0

    def reset(self) -> str:
        """The first decision's text; '' if the opponent folded before the hero had one."""
        self._advance()
        return self._observation() if self.state.status else ""

    def step(self, action: str) -> Step:
        spot = _read_spot(self.state, self.stack, self.history)
        meta = {**spot.__dict__, "legal": spot.legal}
        parsed = parse_action(action)
        played = legal_action(meta, parsed) if parsed else None
        if played is None:
            self.illegal = 1.0
            played = "fold" if self.unreadable == "fold" else ("call" if spot.to_call else "check")
        self._act(played)
        self._advance()
        if self.state.status:
            return Step(self._observation(), 0.0, False)
        return self._result()

    def truncate(self) -> Step:
        """The transcript ran out of room at the hero's decision: the hero folds, as a player whose time runs out,
        and loses the chips committed so far (not the whole stack)."""
        if self.state.status:
            self._act("fold")
            self._advance()
        return self._result()

    def _result(self) -> Step:
        chips = self.state.stacks[self.hero] - self.stack
        info = {"chips": float(chips), "won": float(chips > 0), "illegal": self.illegal}
        return Step("", 0.5 + chips / (2 * self.stack), True, info)

    def _act(self, action: str) -> None:
        seat, street = SEATS[self.state.actor_index], self.state.street_index
        to_call = self.state.checking_or_calling_amount
        if action == "fold":
            self.history.append((street, f"{seat} folds"))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # folding where checking is free
                self.state.fold()
        elif action in ("check", "call"):
            self.history.append((street, f"{seat} {f'calls {to_call}' if to_call else 'checks'}"))
            self.state.check_or_call()
        else:
            raise_to = int(action.split()[1])
            verb = "bets" if max(self.state.bets) == 0 else "raises to"
            self.history.append((street, f"{seat} {verb} {raise_to}"))
            self.state.complete_bet_or_raise_to(raise_to)

    def _advance(self) -> None:
        """Deal and let the opponent act until the hero must act or the hand is over."""
        for _ in range(64):  # a hand has a few dozen events at most
            if not self.state.status:
                return
            while self.state.can_select_runout_count():  # an all-in: one runout, as players agree by default
                self.state.select_runout_count(1)
            _deal_pending(self.state, self.cards)
            if not self.state.status or self.state.actor_index is None:
                continue
            if self.state.actor_index == self.hero:
                return
            self._act(self._opponent_action())
        raise RuntimeError("the hand did not advance: pokerkit state stuck")

    def _opponent_action(self) -> str:
        to_call = self.state.checking_or_calling_amount
        if not to_call:
            return "check"
        villain = 1 - self.hero
        hole = tuple(self.state.hole_cards[villain])
        board = tuple(self.state.get_board_cards(0))
        needed = to_call / (self.state.total_pot_amount + to_call)
        return "call" if percentile(hole, board) >= needed else "fold"

    def _observation(self) -> str:
        return prompt(_read_spot(self.state, self.stack, self.history))


class PokerHandsTask:
    """Options: `stack` chips each player starts with (blinds 1/2: 200 = 100 big blinds); `unreadable`, what an
    unreadable or illegal answer does: "fold" (default) or "call" (check or call)."""

    name = "poker_hands"
    hidden_state = True  # the spec is the deal's seed: the learner steps every hand (learner/episode_host.py)
    max_turns = 4
    max_new_tokens = 16  # per turn: one ACTION line

    def __init__(self, stack: int = 200, unreadable: str = "fold") -> None:
        if isinstance(stack, bool) or not isinstance(stack, int) or not 10 <= stack <= MAX_STACK:
            raise ValueError(f"stack must be an integer from 10 to {MAX_STACK} chips, not {stack!r}")
        if unreadable not in UNREADABLE:
            raise ValueError(f"unreadable must be one of {UNREADABLE}, not {unreadable!r}")
        self.stack, self.unreadable = stack, unreadable

    def episode(self, spec: str) -> Hand:
        return Hand(spec)

    def prompts(self, seed: int, split: Split = "train") -> Iterator[Problem]:
        rng = random.Random(f"poker_hands/{seed}")
        while True:
            spec = f"{self.stack}:{rng.getrandbits(63)}:{self.unreadable}"
            digest = hashlib.sha256(spec.encode()).hexdigest()
            if (int(digest, 16) % 10 == 0) == (split == "eval"):
                hand = Hand(spec)
                first = hand.reset()
                if hand.state.status:  # not a hand the opponent folded before the hero's first decision
                    yield Problem(f"hand-{digest[:16]}", chat(first, SYSTEM), "", {"episode": spec})

    def score(self, problem: Problem, completion: str) -> Any:
        raise TypeError("poker_hands is multi-turn: its transcripts are scored by tasks/episodes.score_transcript")
