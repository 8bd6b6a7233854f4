"""How much of the fp32 master's movement reaches the published bf16 policy in the first steps, with the master
on the bf16 grid (as a model shipped in bf16 loads) against the master dithered inside its rounding intervals
(`--master-dither`, `echo2cli/learner/rounding.py`). The default model, on the CPU.

    .venv/bin/python scripts/bench_dither.py [--lrs 1e-5,5e-5] [--steps 10] [--threads 1] [--json]

For each lr and each start, the model takes `--steps` AdamW steps (betas 0.9, 0.99, as the learner's) that raise
the log-probs of a batch of chat-formatted arithmetic answers, each computed on the weights as published, the
fp32 master stepped, as the learner does. After each step: the share of weights whose published bf16 value has
moved since version 0, and the mean change of the answers' log-probs under the published weights as a share of
their change under the fp32 master ("reached"; 1 = the policy the workers sample moved as the master did).
The grid start is the baseline, measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from echo2cli.learner.rounding import as_published, dither_master  # noqa: E402
from echo2cli.models import prepare_default_model  # noqa: E402
from scripts.bench_rounding import PAIRS, batch, token_logp  # noqa: E402


def trajectory(model_dir: Path, tok: Any, lr: float, steps: int, dither: bool) -> list[dict[str, float]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    params = list(model.parameters())
    if dither:
        dither_master(params, seed=0)
    ids, mask = batch(tok, len(PAIRS))
    n = mask[:, 1:].sum()

    def mean_logp(published: bool) -> float:
        with torch.no_grad():
            if not published:
                return float(token_logp(model, ids, mask).sum() / n)
            with as_published(params):
                return float(token_logp(model, ids, mask).sum() / n)

    with torch.no_grad():
        v0 = [p.to(torch.bfloat16) for p in params]
    start_pub, start_fp32 = mean_logp(True), mean_logp(False)
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.99), weight_decay=0.0)
    rows = []
    for step in range(1, steps + 1):
        opt.zero_grad()
        with as_published(params):
            (-token_logp(model, ids, mask).sum() / n).backward()
        opt.step()
        moved = sum(int((p.to(torch.bfloat16) != b).sum()) for p, b in zip(params, v0, strict=True))
        d_pub, d_fp32 = mean_logp(True) - start_pub, mean_logp(False) - start_fp32
        rows.append(
            {
                "step": step,
                "moved_frac": moved / sum(p.numel() for p in params),
                "d_logp_published": d_pub,
                "d_logp_fp32": d_fp32,
                "reached": d_pub / d_fp32 if d_fp32 else float("nan"),
            }
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lrs", default="1e-5,5e-5", help="learning rates, comma-separated")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    a = ap.parse_args()
    from rich.console import Console
    from rich.table import Table
    from transformers import AutoTokenizer

    torch.set_num_threads(a.threads)
    model_dir = prepare_default_model()
    tok = AutoTokenizer.from_pretrained(model_dir)
    starts = ("grid", "dithered")
    out = {
        lr: {start: trajectory(model_dir, tok, float(lr), a.steps, start == "dithered") for start in starts}
        for lr in a.lrs.split(",")
    }
    if a.json:
        print(json.dumps(out, indent=2))
        return
    for lr, runs in out.items():
        table = Table(title=f"lr {lr}: the published bf16 policy against the fp32 master")
        for col in ("step", "grid: weights moved", "grid: reached", "dithered: weights moved", "dithered: reached"):
            table.add_column(col, justify="right")
        for g, d in zip(runs["grid"], runs["dithered"], strict=True):
            table.add_row(
                str(g["step"]),
                f"{g['moved_frac']:.2%}",
                f"{g['reached']:.2f}",
                f"{d['moved_frac']:.2%}",
                f"{d['reached']:.2f}",
            )
        Console().print(table)


if __name__ == "__main__":
    main()
