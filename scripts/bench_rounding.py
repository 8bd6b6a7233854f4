"""What reading fp32 weights instead of the published bf16 ones costs the trainer's log-probs, and what computing
with the published ones (`echo2cli/learner/rounding.py`) costs a step. The default model, on the CPU.

    .venv/bin/python scripts/bench_rounding.py [--lrs 5e-5,2e-4] [--threads 1] [--json]

Gap: for each lr, the model in fp32 takes one AdamW step (betas 0.9, 0.99, as the learner's) that lowers the
log-probs of a batch of chat-formatted arithmetic answers; then those tokens are scored with the fp32 weights
and with the same weights rounded to bf16 (what a worker receives). The mean and largest |difference| are
what a trainer reading fp32 would take for staleness at staleness 0.

Cost: `as_published` (round in place, put the fp32 master back) on every parameter (no bf16 compute) and on
those bf16 compute leaves at fp32 (embeddings, norms), against the learner's whole step (`Trainer.step` in fp32,
rounding included) on a batch of the default shape (4 prompts x 8 samples x 16 tokens) in the same run.
Medians of --repeats. Prints a table and, with --json, the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from echo2cli.learner.rounding import as_published, read_at_fp32  # noqa: E402
from echo2cli.models import prepare_default_model  # noqa: E402

PAIRS = [(3, 8), (17, 4), (42, 8), (9, 1), (25, 13), (7, 6), (30, 12), (11, 11)]


def batch(tok, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`size` chat-formatted "Compute a + b." prompts with their answers, right-padded; ids and attention mask."""
    texts = []
    for i in range(size):
        a, b = PAIRS[i % len(PAIRS)]
        chat = [
            {"role": "user", "content": f"Compute {a} + {b}. Reply with only the number."},
            {"role": "assistant", "content": str(a + b)},
        ]
        texts.append(tok.apply_chat_template(chat, tokenize=False))
    enc = tok(texts, return_tensors="pt", padding=True)
    return enc["input_ids"], enc["attention_mask"]


def token_logp(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    logp = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float().log_softmax(-1)
    return logp.gather(-1, ids[:, 1:, None])[..., 0] * mask[:, 1:]


def gap(model_dir: Path, tok, lr: float) -> dict[str, float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids, mask = batch(tok, len(PAIRS))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=0.0)
    (token_logp(model, ids, mask).sum() / mask[:, 1:].sum()).backward()
    opt.step()
    with torch.no_grad():
        fp32 = token_logp(model, ids, mask)
        params = list(model.parameters())
        with as_published(params):
            rounded = token_logp(model, ids, mask)
        moved = sum(int((p != p.to(torch.bfloat16).float()).sum()) for p in params)
    diff = (fp32 - rounded).abs()
    n = int(mask[:, 1:].sum())
    return {
        "lr": lr,
        "mean_abs_nats": float(diff.sum()) / n,
        "max_abs_nats": float(diff.max()),
        "weights_off_grid": moved,
    }


def cost(model_dir: Path, tok, repeats: int) -> dict[str, float]:
    """The learner's own step (`Trainer.step`, which rounds inside) on a batch of the default shape, and
    `as_published` alone on what that trainer rounds and on what bf16 compute would leave it to round."""
    from echo2cli.learner.trainer import Trainer
    from echo2cli.learner.types import Group
    from echo2cli.protocol import Sample

    tr = Trainer(
        model_dir, lr=5e-5, clip_eps=0.2, is_cap=3.0, kl_coef=0.0, max_grad_norm=1.0, micro_batch=8, bf16=False
    )
    gen = torch.Generator().manual_seed(0)
    groups = []
    for k in range(4):  # B = 4 prompts x G = 8 samples of 16 tokens, as the default run's step
        a, b = PAIRS[k]
        chat = [{"role": "user", "content": f"Compute {a} + {b}. Reply with only the number."}]
        prompt = tok(tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))["input_ids"]
        samples = [
            Sample(
                prompt_id=k,
                sample_idx=i,
                completion_token_ids=torch.randint(100, 1000, (16,), generator=gen).tolist(),
                logprobs=[-5.0] * 16,
            )
            for i in range(8)
        ]
        groups.append(Group(k, 0, prompt, samples, [float(i % 2) for i in range(8)], "w"))

    def median_s(fn, *args) -> float:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn(*args)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    def rounding(params: list) -> None:
        with as_published(params):
            pass

    out = {"step_s": median_s(tr.step, groups)}
    for name, params in (("all", read_at_fp32(tr.model, False)), ("uncast", read_at_fp32(tr.model, True))):
        out[f"round_{name}_params"] = sum(p.numel() for p in params)
        out[f"round_{name}_s"] = median_s(rounding, params)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lrs", default="5e-5,2e-4", help="learning rates of the one-step gap, comma-separated")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the bench learner's: 1)")
    ap.add_argument("--repeats", type=int, default=5, help="timings per figure; the median is kept")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    a = ap.parse_args()
    from rich.console import Console
    from rich.table import Table
    from transformers import AutoTokenizer

    torch.set_num_threads(a.threads)
    model_dir = prepare_default_model()
    tok = AutoTokenizer.from_pretrained(model_dir)
    gaps = [gap(model_dir, tok, float(lr)) for lr in a.lrs.split(",")]
    c = cost(model_dir, tok, a.repeats)
    if a.json:
        print(json.dumps({"gaps": gaps, "cost": c}, indent=2))
        return
    table = Table(title="fp32 weights against the same rounded to bf16, one AdamW step in")
    for col in ("lr", "mean |diff| (nats)", "max |diff|", "weights off the bf16 grid"):
        table.add_column(col, justify="right")
    for g in gaps:
        table.add_row(
            f"{g['lr']:g}", f"{g['mean_abs_nats']:.3f}", f"{g['max_abs_nats']:.2f}", f"{g['weights_off_grid']:,}"
        )
    Console().print(table)
    base = c["step_s"]
    print(f"Trainer.step, 4 prompts x 8 samples x 16 tokens, rounding included: {base:.2f} s ({a.threads} thread(s))")
    for name in ("all", "uncast"):
        s = c[f"round_{name}_s"]
        print(f"as_published on {c[f'round_{name}_params'] / 1e6:.1f}M params ({name}): {s:.3f} s = {s / base:.3f}x")


if __name__ == "__main__":
    main()
