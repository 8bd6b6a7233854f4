"""`echo2 eval` of the default model on a 200-problem split of each built-in task, timed end to end.

    .venv/bin/python scripts/bench_eval.py                      # arithmetic, math, poker; 200 problems each
    .venv/bin/python scripts/bench_eval.py --tasks poker --baseline
    .venv/bin/python scripts/bench_eval.py --tasks math --k 0     # greedy only

Each eval runs as its own `echo2 eval --task T --limit N --json` process, so the wall time is what a user
waits for: Python start, engine start, generation and scoring, engine shutdown. Printed against the
goal of 120 s per task. The shipped math sample holds out only 17 problems, so math runs on a file of N
templated word problems (GSM8K shape, `split: eval`) that this script writes; see `math_file`.

`--baseline` runs each eval a second time with vLLM's own CPU binding (`VLLM_CPU_OMP_THREADS_BIND=auto`:
the model on all cores but one, the other kept for vLLM's scheduler), against echo2's all cores for
`echo2 eval`, and prints the ratio. The effect of the KV block size is measured by
`scripts/bench_engine.py --baseline block128`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from fractions import Fraction
from pathlib import Path

GOAL_S = 120.0
NAMES = ["Ana", "Ben", "Mia", "Tom", "Zoe", "Raj", "Li", "Sam"]
ITEMS = ["apples", "stickers", "marbles", "pencils", "cards", "coins"]


def math_problem(rng: random.Random) -> tuple[str, str]:
    """One templated problem: (question, GSM8K-style answer with `#### final`)."""
    kind = rng.randrange(5)
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    if kind == 0:
        a, b, c = rng.randint(5, 40), rng.randint(2, 30), rng.randint(1, 5)
        return (
            f"{name} has {a} {item}, gets {b} more and gives away {c}. How many {item} are left?",
            f"#### {a + b - c}",
        )
    if kind == 1:
        a, b = rng.randint(3, 15), rng.randint(2, 12)
        return f"A box holds {a} {item}. How many {item} are in {b} boxes?", f"#### {a * b}"
    if kind == 2:
        q, b = rng.randint(2, 12), rng.randint(2, 9)
        return f"{q * b} {item} are shared equally by {b} friends. How many does each get?", f"#### {q}"
    if kind == 3:
        x, a, b = rng.randint(-9, 12), rng.randint(2, 9), rng.randint(-20, 20)
        return f"Solve for x: {a}x + {b} = {a * x + b}.", f"#### {x}"
    p, q = Fraction(rng.randint(1, 5), rng.randint(2, 7)), Fraction(rng.randint(1, 5), rng.randint(2, 7))
    total = p + q
    answer = str(total.numerator) if total.denominator == 1 else f"\\frac{{{total.numerator}}}{{{total.denominator}}}"
    return f"What is {p} + {q}? Give the answer as a fraction in lowest terms.", f"#### {answer}"


def math_file(path: Path, n_eval: int, seed: int = 0) -> Path:
    rng = random.Random(seed)
    seen: set[str] = set()
    lines = []
    while len(lines) < n_eval + 20:  # 20 training lines: the task refuses a file without any
        question, answer = math_problem(rng)
        if question in seen:
            continue
        seen.add(question)
        split = "eval" if len(lines) < n_eval else "train"
        lines.append(json.dumps({"question": question, "answer": answer, "split": split}))
    path.write_text("\n".join(lines) + "\n")
    return path


def run_eval(task: str, limit: int, out: Path, extra: list[str], env: dict[str, str]) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "echo2cli",
        "eval",
        "--task",
        task,
        "--limit",
        str(limit),
        "--json",
        "--out",
        str(out),
        *extra,
    ]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text()) | {"wall_s": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", default="arithmetic,math,poker")
    ap.add_argument("--limit", type=int, default=200)
    ap.add_argument("--k", type=int, help="samples per problem for pass@k (default: echo2 eval's; 0 = greedy only)")
    ap.add_argument("--baseline", action="store_true", help="also run with vLLM's default CPU binding")
    ap.add_argument("--json", type=Path, help="write every result here")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="bench-eval-"))
    results = []
    for task in args.tasks.split(","):
        extra = ["--option", f"path={math_file(tmp / 'math.jsonl', args.limit)}"] if task == "math" else []
        extra += ["--k", str(args.k)] if args.k is not None else []
        variants = [("echo2", {})] + (
            [("vllm-default-binding", {"VLLM_CPU_OMP_THREADS_BIND": "auto"})] if args.baseline else []
        )
        for label, env_extra in variants:
            env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_OMP_THREADS_BIND"} | env_extra
            r = run_eval(task, args.limit, tmp / f"{task}-{label}.json", extra, env) | {"variant": label}
            results.append(r)
            print(
                f"{task:<11} {label:<21} {r['problems']:>4} problems  wall {r['wall_s']:6.1f} s "
                f"(engine {r['t_engine_s']:5.1f} s, generate+score {r['t_eval_s']:6.1f} s)  "
                f"greedy acc {r['greedy_accuracy']:.3f}  pass@{r['k']} {r['pass_at_k']:.3f}  "
                f"max_new_tokens {r['max_new_tokens']}  wall/goal {r['wall_s'] / GOAL_S:.2f}x",
                flush=True,
            )
        if args.baseline:
            ours, base = results[-2], results[-1]
            print(
                f"{task:<11} speed-up over vLLM's default binding: {base['wall_s'] / ours['wall_s']:.2f}x wall, "
                f"{base['t_eval_s'] / ours['t_eval_s']:.2f}x generate+score",
                flush=True,
            )
    if args.json:
        args.json.write_text(json.dumps([{k: v for k, v in r.items() if k != "examples"} for r in results], indent=2))


if __name__ == "__main__":
    main()
