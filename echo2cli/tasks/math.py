"""Math word problems from a JSONL file or any local dataset, graded by math-verify on the last \\boxed{} answer.

Data: a JSONL file (one JSON object per line, blank lines skipped), or anything `datasets.load_dataset` reads
from a local path: a parquet, CSV or JSON file, a directory of them (a Hugging Face dataset repository as
downloaded), or an Arrow directory written by `Dataset.save_to_disk`. The question is `question` or `problem`
(or `question_column`); the gold final answer comes from `answer_column` if given, else from the first of
these shapes that fits:

    GSM8K   {"question": "...", "answer": "... reasoning ... #### 42"}      the text after the last ####
    MATH    {"problem": "...", "solution": "... \\boxed{\\frac{1}{2}} ..."}   the last \\boxed{...} (balanced braces)
    plain   {"problem": "...", "answer": "7"}  (AIME and the like)         the whole answer: an integer, a
                                                                          fraction, a decimal or LaTeX
An `answer_column`'s text is read by its shape: after the last #### (GSM8K), else its last \\boxed{} (MATH's
`solution`), else the whole text. Optional fields: `id` (default: the first 12 hex digits of the SHA-256 of the
question) and `split` ("train" or "eval"; default: eval if the SHA-256 of the question falls in bucket 0 of
`eval_every`, so 1/5 of the problems by default). A dataset with named splits trains on `split` (default
"train", or its only split) and, given `eval_split` ("test"), holds that split out instead of hashing. A line
that repeats an earlier problem (same id and question) is skipped; a malformed line is a ValueError naming the
file and line. With no `path`, the task uses the shipped sample
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
import re
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from math_verify import parse, verify

from echo2cli.tasks import Problem, Score, Split, chat, fixed_split

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


def gold_from_text(text: Any) -> tuple[str, str]:
    """(gold answer, shape) of a named answer column: after ####, else the last \\boxed{}, else the text."""
    if isinstance(text, bool) or not isinstance(text, str | int | float):
        raise ValueError(f"the answer must be a string or a number, not {type(text).__name__}")
    text = str(text)
    if "####" in text:
        return text.rsplit("####", 1)[1].strip(), "gsm8k"
    boxed = last_boxed(text)
    return (boxed.strip(), "math") if boxed is not None else (text.strip(), "plain")


@dataclass(frozen=True)
class Columns:
    """Which fields hold the question and the answer (None: the shapes of the module docstring)."""

    question: str | None = None
    answer: str | None = None

    def question_of(self, record: dict[str, Any]) -> Any:
        if self.question is not None:
            if self.question not in record:
                raise ValueError(f"no column {self.question!r} (columns: {sorted(record)})")
            return record[self.question]
        return record.get("question", record.get("problem"))

    def answer_of(self, record: dict[str, Any]) -> tuple[str, str]:
        if self.answer is None:
            return gold_answer(record)
        if self.answer not in record:
            raise ValueError(f"no column {self.answer!r} (columns: {sorted(record)})")
        return gold_from_text(record[self.answer])


def jsonl_records(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """("line N", record) of each non-blank line."""
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as exc:
            raise ValueError(f"{path} line {number}: {exc}") from None
        if not isinstance(record, dict):
            raise ValueError(f"{path} line {number}: not a JSON object")
        yield f"line {number}", record


def dataset_splits(path: Path) -> dict[str, list[dict[str, Any]]]:
    """Every split of a local dataset as rows, read by `datasets` (its cache in a temporary directory)."""
    import datasets

    datasets.disable_progress_bars()
    with tempfile.TemporaryDirectory(prefix="echo2-datasets-") as cache:
        try:
            if path.is_dir() and any((path / f).exists() for f in ("dataset_info.json", "dataset_dict.json")):
                loaded: Any = datasets.load_from_disk(str(path), keep_in_memory=True)
            elif path.is_dir():
                loaded = datasets.load_dataset(str(path), cache_dir=cache, keep_in_memory=True)
            else:
                builder = DATASET_BUILDERS.get(path.suffix.lower())
                if builder is None:
                    raise ValueError(f"unknown data file type {path.suffix!r}: use one of {sorted(DATASET_BUILDERS)}")
                loaded = datasets.load_dataset(builder, data_files=str(path), cache_dir=cache, keep_in_memory=True)
        except (datasets.exceptions.DatasetGenerationError, FileNotFoundError, ValueError, OSError) as exc:
            raise ValueError(f"cannot read dataset {path}: {exc}") from None
        if isinstance(loaded, datasets.Dataset):
            return {"train": loaded.to_list()}
        return {name: part.to_list() for name, part in loaded.items()}


DATASET_BUILDERS = {".parquet": "parquet", ".csv": "csv", ".json": "json", ".arrow": "arrow", ".tsv": "csv"}


def records_of(
    path: Path, split: str | None, eval_split: str | None
) -> Iterator[tuple[str, dict[str, Any], str | None]]:
    """(where in the file, record, forced split) of each row: a JSONL file line by line, else through `datasets`."""
    if path.is_file() and path.suffix.lower() == ".jsonl":
        if split or eval_split:
            raise ValueError("split and eval_split name a dataset's splits: a JSONL file marks them per line")
        for where, record in jsonl_records(path):
            yield where, record, None
        return
    splits = dataset_splits(path)
    train_name = split or ("train" if "train" in splits or len(splits) != 1 else next(iter(splits)))
    for name in (train_name, eval_split):
        if name is not None and name not in splits:
            raise ValueError(f"{path} has no split {name!r} (splits: {sorted(splits)})")
    for name, forced in ((train_name, "train" if eval_split else None), (eval_split, "eval")):
        for i, record in enumerate(splits[name] if name else []):
            yield f"split {name} row {i}", record, forced


def load_problems(
    path: Path,
    eval_every: int,
    columns: Columns = Columns(),
    split: str | None = None,
    eval_split: str | None = None,
) -> tuple[list[Problem], list[Problem]]:
    """(train, eval) problems of a JSONL file or a local dataset, in file order."""
    if not path.exists():
        raise FileNotFoundError(f"no math data file at {path}")
    splits: dict[str, list[Problem]] = {"train": [], "eval": []}
    seen: dict[str, tuple[str, str]] = {}
    for where, record, forced in records_of(path, split, eval_split):
        try:
            question = columns.question_of(record)
            if not isinstance(question, str) or not question.strip():
                raise ValueError("no 'question' or 'problem' text")
            answer, shape = columns.answer_of(record)
            if not answer:
                raise ValueError("empty answer")
            digest = stable_hash(question)
            part = forced or record.get("split", "eval" if int(digest, 16) % eval_every == 0 else "train")
            if part not in splits:
                raise ValueError(f"split must be 'train' or 'eval', not {part!r}")
        except ValueError as exc:
            raise ValueError(f"{path} {where}: {exc}") from None
        pid = str(record.get("id", digest[:12]) if record.get("id") is not None else digest[:12])
        if pid in seen:
            if seen[pid][0] != question:
                raise ValueError(f"{path} {where}: id {pid!r} is already used on {seen[pid][1]}")
            continue
        seen[pid] = (question, where)
        messages = chat(question, system=SYSTEM_PROMPT)
        splits[part].append(Problem(id=pid, messages=messages, answer=answer, meta={"shape": shape}))
    if not splits["train"]:
        raise ValueError(f"{path} has no training problems ({len(splits['eval'])} eval)")
    return splits["train"], splits["eval"]


class MathTask:
    """Options ([learner.task_options], or `echo2 eval --option KEY=VALUE`): `path` of a JSONL file or a local
    dataset (default: the shipped sample), `question_column` and `answer_column` (default: the shapes above),
    `split` and `eval_split` (a dataset's named splits), and `eval_every` (default 5: one problem in 5 is held
    out, unless lines name their split or `eval_split` is given)."""

    name = "math"
    max_new_tokens = 128  # a suggestion for `echo2 eval`: a short derivation and a boxed answer

    def __init__(
        self,
        path: str | None = None,
        eval_every: int = 5,
        question_column: str | None = None,
        answer_column: str | None = None,
        split: str | None = None,
        eval_split: str | None = None,
    ) -> None:
        if isinstance(eval_every, bool) or not isinstance(eval_every, int) or eval_every < 2:
            raise ValueError(f"eval_every must be an integer >= 2, not {eval_every!r}")
        self.path = Path(path).expanduser() if path else SAMPLE_PATH
        columns = Columns(question_column, answer_column)
        self.train, self.eval = load_problems(self.path, eval_every, columns, split, eval_split)

    def prompts(self, seed: int, split: Split = "train") -> Iterator[Problem]:
        return fixed_split(self.train, self.eval, seed, split)

    def score(self, problem: Problem, completion: str) -> Score:
        tail = completion[-TAIL_CHARS:]
        boxed = last_boxed(tail)
        answer = boxed if boxed is not None else last_number(tail)
        correct = float(answer is not None and equivalent(problem.answer, answer))
        formatted = float(boxed is not None)
        return Score(0.8 * correct + 0.2 * formatted, {"correct": correct, "format": formatted})
