"""Whole poker hands: a model's chips per held-out hand against scripted players on the same hands.

    .venv/bin/python scripts/bench_poker_hands.py [--model default] [--hands 200] [--k 4] [--unreadable fold] [--json]

The model plays each hand of the held-out split through `echo2 eval --task poker_hands` (vLLM, greedy, and k
samples at temperature 1, scored by the learner's replay). The same hands are then played by three scripted
players against the same documented opponent: always fold, always check or call, and a uniformly random legal
answer (seeded). Reported: chips per hand (greedy, sampled) and each scripted player's, and the model's margin
over the best scripted player, all measured in this run.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys

from echo2cli.evaluate import eval_problems
from echo2cli.tasks.poker_hands import Hand, PokerHandsTask

SCRIPTED = {
    "always fold": lambda rng: "ACTION: fold",
    "always check/call": lambda rng: "ACTION: call",
    "random": lambda rng: rng.choice(["ACTION: fold", "ACTION: call", "ACTION: raise 8", "ACTION: all-in"]),
}


def scripted_chips(specs: list[str], player: str, seed: int = 0) -> float:
    """Mean chips per hand of a scripted player (an illegal answer, as for the model, does what the spec says)."""
    rng = random.Random(seed)
    total = 0.0
    for spec in specs:
        hand = Hand(spec)
        hand.reset()
        while not (step := hand.step(SCRIPTED[player](rng))).done:
            pass
        total += step.info["chips"]
    return total / len(specs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--hands", type=int, default=200)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--unreadable", default="fold", choices=["fold", "call"])
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    task = PokerHandsTask(unreadable=args.unreadable)
    specs = [p.meta["episode"] for p in eval_problems(task, args.hands, seed=0)]
    cmd = [sys.executable, "-m", "echo2cli", "eval", "--json", "--task", "poker_hands", "--model", args.model]
    cmd += ["--option", f"unreadable={args.unreadable}", "--limit", str(args.hands), "--k", str(args.k)]
    cmd += ["--max-new-tokens", str(args.max_new_tokens)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
    result = json.loads([line for line in proc.stdout.splitlines() if line.startswith('{"model"')][-1])
    assert result["problems"] == len(specs)
    scripted = {name: scripted_chips(specs, name) for name in SCRIPTED}
    best = max(scripted, key=scripted.__getitem__)
    row = {
        "hands": len(specs),
        "unreadable": args.unreadable,
        "max_new_tokens": args.max_new_tokens,
        "model": result["model"],
        "greedy_chips_per_hand": result["greedy_chips"],
        "greedy_illegal_frac": result["greedy_illegal"],
        "greedy_turns": result["greedy_turns"],
        "sampled_reward": result["sampled_reward"],
        "sampled_chips_per_hand": (result["sampled_reward"] - 0.5) * 2 * task.stack,
        "scripted_chips_per_hand": scripted,
        "margin_over_best_scripted": result["greedy_chips"] - scripted[best],
        "best_scripted": best,
        "t_eval_s": result["t_eval_s"],
    }
    if args.json:
        print(json.dumps(row))
        return
    print(f"{row['hands']} held-out hands, unreadable = {args.unreadable}, {args.max_new_tokens} tokens per turn")
    print(
        f"model (greedy): {row['greedy_chips_per_hand']:+.2f} chips/hand, {row['greedy_illegal_frac']:.0%} of hands "
        f"with an unreadable answer, {row['greedy_turns']:.2f} turns/hand"
    )
    print(f"model (sampled, k={args.k}): {row['sampled_chips_per_hand']:+.2f} chips/hand")
    for name, chips in scripted.items():
        print(f"{name}: {chips:+.2f} chips/hand")
    print(f"margin over the best scripted player ({best}): {row['margin_over_best_scripted']:+.2f} chips/hand")


if __name__ == "__main__":
    main()
