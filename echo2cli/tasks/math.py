"""Math word problems from a JSONL file, graded by math-verify on the last \\boxed{} answer.

Data: one JSON object per line (blank lines are skipped). The question is `question` or `problem`;
the gold final answer comes from the first of these shapes that fits:

    GSM8K   {"question": "...", "answer": "... reasoning ... #### 42"}      the text after the last ####
    MATH    {"problem": "...", "solution": "... \\boxed{\\frac{1}{2}} ..."}   the last \\boxed{...} (balanced braces)
    plain   {"problem": "...", "answer": "7"}  (AIME and the like)         the whole answer: an integer, a
                                                                          fraction, a decimal or LaTeX
Optional fields: `id` (default: the first 12 hex digits of the SHA-256 of the question) and `split`
("train" or "eval"; default: eval if the SHA-256 of the question falls in bucket 0 of `eval_every`, so
1/5 of the problems by default). A line that repeats an earlier problem (same id and question) is skipped;
a malformed line is a ValueError naming the file and line. With no `path`, the task uses the shipped sample
(data/math_sample.jsonl: 84 short original problems for small models, 17 of them held out).

Prompts: a system message asks for brief reasoning and the final answer in \\boxed{}. The train split is
endless: each epoch is a shuffle of the train problems seeded by (seed, epoch). The eval split is each eval
problem once, in file order.

Reward = 0.8 * correct + 0.2 * format, in [0, 1]. `format` = 1 if the completion has a \\boxed{...};
`correct` = 1 if math-verify finds that answer equal to the gold one (0.5 = 1/2 = \\frac{1}{2}, 3 = 3.0,
\\sqrt{8} = 2\\sqrt{2}), or, without a box, the last number of the completion. Only the last 4,000 characters
of a completion are read, and an answer that could make SymPy run for minutes is refused (correct = 0): longer
than 200 characters, a number of more than 50 digits, a factorial, a LaTeX command outside SAFE_COMMANDS
(\\frac, \\sqrt, \\pi, \\text, ...; not \\sin, \\Gamma, \\binom, \\sum), brackets nested more than 5 deep, an exponent
holding an exponent, or exponents multiplying past 200. An answer written exactly as the gold one is correct
without these checks. math-verify's own timeouts use SIGALRM, which works only in a process's main thread, so
they are off; scoring.Scorer still bounds the time from outside (random 2-variable expressions that pass these
checks can still take seconds).
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import re
from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path
from typing import Any

from math_verify import parse, verify

from echo2cli.tasks import Problem, Score, Split, chat

# math-verify warns once that its timeouts are off; that is deliberate here (see above).
logging.getLogger("math_verify").setLevel(logging.ERROR)

SAMPLE_PATH = Path(__file__).with_name("data") / "math_sample.jsonl"
SYSTEM_PROMPT = "Solve the problem. Reason briefly, then give the final answer in \\boxed{}."

TAIL_CHARS = 4000
MAX_ANSWER_CHARS = 200
MAX_DIGITS = 50
MAX_EXPONENT_PRODUCT = 200  # (x+1)^{99} - (x-1)^{99} already takes ~2 s to compare
MAX_DEPTH = 5  # of nested brackets: 16 nested \frac{1}{...} take 5 s, 8 nested \sin(...) 18 s

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:/\d+)?")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}\b)")
_LONG_NUMBER = re.compile(rf"\d{{{MAX_DIGITS + 1},}}")
_FACTORIAL = re.compile(r"(?<!\\)!")
# LaTeX commands an answer may use. Not \Gamma(10^9), \binom, \exp, \sum, \int, nor even \sin or \log:
# math-verify needs minutes for \sin(1)\sin(2)...\sin(20).
SAFE_COMMANDS = frozenset(
    "frac dfrac tfrac sqrt cdot times div pm mp pi infty circ degree left right displaystyle "
    "text textbf textrm mathrm mathbf mbox le ge leq geq lt gt ne neq approx in cup cap emptyset "
    "varnothing dots ldots cdots quad qquad alpha beta theta".split()
)


def stable_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def last_boxed(text: str) -> str | None:
    """The contents of the last \\boxed{...} whose braces balance, in one pass over `text`."""
    opened: list[int] = []
    best = -1
    content = None
    for i, ch in enumerate(text):
        if ch == "{":
            opened.append(i)
        elif ch == "}" and opened:
            start = opened.pop()
            if start > best and text.endswith("\\boxed", 0, start):
                best, content = start, text[start + 1 : i]
    return content


def last_number(text: str) -> str | None:
    found = _NUMBER.findall(_THOUSANDS.sub("", text))
    return found[-1] if found else None


def _exponents(text: str) -> Iterator[str]:
    """What follows each ^: a balanced {...} or (...) group, or one character; after a command
    (^\\frac{9}{2}) all the rest, to be safe."""
    for match in re.finditer(r"\^\s*", text):
        rest = text[match.end() :]
        if rest[:1] not in ("{", "("):
            yield rest if rest.startswith("\\") else rest[:1]
            continue
        close = "}" if rest[0] == "{" else ")"
        depth = 0
        for i, ch in enumerate(rest):
            depth += (ch == rest[0]) - (ch == close)
            if depth == 0:
                yield rest[1:i]
                break
        else:
            yield rest[1:]


def _depth(text: str) -> int:
    depth = deepest = 0
    for ch in text:
        depth += (ch in "([{") - (ch in ")]}")
        deepest = max(deepest, depth)
    return deepest


def tame(answer: str) -> bool:
    """Whether SymPy can evaluate `answer` quickly (see the module docstring for what is refused)."""
    if len(answer) > MAX_ANSWER_CHARS or _LONG_NUMBER.search(answer) or _FACTORIAL.search(answer):
        return False
    if not set(re.findall(r"\\([a-zA-Z]+)", answer)) <= SAFE_COMMANDS or _depth(answer) > MAX_DEPTH:
        return False
    product = 1
    for exponent in _exponents(answer):
        if "^" in exponent:
            return False
        product *= max([int(n) for n in re.findall(r"\d+", exponent)] + [1])
        if product > MAX_EXPONENT_PRODUCT:
            return False
    return True


@lru_cache(maxsize=4096)
def _parse(answer: str) -> list[Any]:
    return list(parse(f"\\boxed{{{answer}}}", parsing_timeout=None))


def equivalent(gold: str, answer: str) -> bool:
    """math-verify's verdict on `answer` against `gold`; False for an untamed answer or any failure."""
    answer = answer.strip().removesuffix(".")  # a sentence's full stop inside the box: \boxed{7.}
    if answer == gold.strip():
        return True
    if not tame(answer):
        return False
    try:
        return bool(verify(_parse(gold), _parse(answer), timeout_seconds=None))
    except Exception:  # SymPy on untrusted input can fail in many ways; a failure is a wrong answer
        return False


def gold_answer(record: dict[str, Any]) -> tuple[str, str]:
    """(gold answer, shape) of one record; ValueError when it has none."""
    if "answer" in record:
        answer = record["answer"]
        if isinstance(answer, bool) or not isinstance(answer, str | int | float):
            raise ValueError(f"'answer' must be a string or a number, not {type(answer).__name__}")
        answer = str(answer)
        if "####" in answer:
            return answer.rsplit("####", 1)[1].strip(), "gsm8k"
        return answer.strip(), "plain"
    if "solution" in record:
        boxed = last_boxed(str(record["solution"]))
        if boxed is None:
            raise ValueError("'solution' has no \\boxed{...} answer")
        return boxed.strip(), "math"
    raise ValueError("no 'answer' or 'solution'")


def load_problems(path: Path, eval_every: int) -> tuple[list[Problem], list[Problem]]:
    """(train, eval) problems of a JSONL file, in file order."""
    if not path.is_file():
        raise FileNotFoundError(f"no math data file at {path}")
    splits: dict[str, list[Problem]] = {"train": [], "eval": []}
    seen: dict[str, tuple[str, int]] = {}
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record, dict):
                raise ValueError("not a JSON object")
            question = record.get("question", record.get("problem"))
            if not isinstance(question, str) or not question.strip():
                raise ValueError("no 'question' or 'problem' text")
            answer, shape = gold_answer(record)
            if not answer:
                raise ValueError("empty answer")
            digest = stable_hash(question)
            split = record.get("split", "eval" if int(digest, 16) % eval_every == 0 else "train")
            if split not in splits:
                raise ValueError(f"split must be 'train' or 'eval', not {split!r}")
        except ValueError as exc:  # json.JSONDecodeError is one
            raise ValueError(f"{path} line {number}: {exc}") from None
        pid = str(record.get("id", digest[:12]))
        if pid in seen:
            if seen[pid][0] != question:
                raise ValueError(f"{path} line {number}: id {pid!r} is already used on line {seen[pid][1]}")
            continue
        seen[pid] = (question, number)
        messages = chat(question, system=SYSTEM_PROMPT)
        splits[split].append(Problem(id=pid, messages=messages, answer=answer, meta={"shape": shape}))
    if not splits["train"]:
        raise ValueError(f"{path} has no training problems ({len(splits['eval'])} eval)")
    return splits["train"], splits["eval"]


class MathTask:
    """Options ([learner.task_options]): `path` of a JSONL file (default: the shipped sample) and
    `eval_every` (default 5: one problem in 5 is held out, unless lines name their split)."""

    name = "math"
    max_new_tokens = 128  # a suggestion for `echo2 eval`: a short derivation and a boxed answer

    def __init__(self, path: str | None = None, eval_every: int = 5) -> None:
        if isinstance(eval_every, bool) or not isinstance(eval_every, int) or eval_every < 2:
            raise ValueError(f"eval_every must be an integer >= 2, not {eval_every!r}")
        self.path = Path(path).expanduser() if path else SAMPLE_PATH
        self.train, self.eval = load_problems(self.path, eval_every)

    def prompts(self, seed: int, split: Split = "train") -> Iterator[Problem]:
        if split == "eval":
            yield from self.eval
            return
        epoch = 0
        while True:
            order = list(self.train)
            random.Random(f"{seed}/{epoch}").shuffle(order)
            yield from order
            epoch += 1

    def score(self, problem: Problem, completion: str) -> Score:
        tail = completion[-TAIL_CHARS:]
        boxed = last_boxed(tail)
        answer = boxed if boxed is not None else last_number(tail)
        correct = float(answer is not None and equivalent(problem.answer, answer))
        formatted = float(boxed is not None)
        return Score(0.8 * correct + 0.2 * formatted, {"correct": correct, "format": formatted})
