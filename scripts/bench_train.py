"""T_train of one GRPO step on the default model: echo2's step (a packed micro-batch with each group's shared
prompt run once, the vocabulary projection on completion positions only) against the same packed step with every
sequence run whole, and against a right-padded batch with the full-vocabulary projection on every position (the
baselines these replace).

    .venv/bin/python scripts/bench_train.py [--prompts 4] [--group-size 8] [--completion-tokens 12] [--repeats 3]
                                            [--flat-groups 0]

Prints the median seconds of each and the ratios. Batches are synthetic token ids with the shape of the default
demo's (a 44-token chat-templated prompt, `--completion-tokens` sampled tokens). With `--flat-groups K`, K of the
groups are flat (all rewards equal, as when every sample of a prompt is right): echo2's step skips them
(`skip_flat_groups`), and a fourth variant runs them too, the baseline of that skip; the share of tokens left to
train bounds its ratio. Last, the lower bound on echo2's step: its matrix products' FLOPs (forward, and backward's
two products per weight) over the tokens it trains, at the rate this box multiplies the MLP's matrices at, with the
same threads; the ratio is how far the step is from the box's own matmul rate (everything else in it, attention,
softmax, AdamW, copies, adds to the bound).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from echo2cli.learner.trainer import TokenLogp, Trainer
from echo2cli.learner.types import Group
from echo2cli.models import prepare_default_model
from echo2cli.protocol import Sample

PROMPT_TOKENS = 44  # the default demo's chat-templated prompt


def full_projection_logp(self, model, pack):
    """The rows right-padded in one batch, every position projected onto the vocabulary; completion-aligned."""
    model = model.model if isinstance(model, TokenLogp) else model  # the causal LM inside
    length = max(len(r[0]) + len(r[1]) for r in pack.rows)
    ids = torch.zeros((len(pack.rows), length), dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, (p, c, *_) in enumerate(pack.rows):
        ids[i, : len(p) + len(c)], attn[i, : len(p) + len(c)] = torch.tensor(p + c), 1
    with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
    logp = -F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
    out = torch.zeros(pack.shape)
    for i, (p, c, *_) in enumerate(pack.rows):
        out[i, : len(c)] = logp[i, len(p) - 1 : len(p) + len(c) - 1]
    return out * pack.mask


def make_groups(prompts: int, g: int, completion: int, flat: int = 0, seed: int = 0) -> list[Group]:
    gen = torch.Generator().manual_seed(seed)
    groups = []
    for p in range(prompts):
        prompt = torch.randint(100, 40000, (PROMPT_TOKENS,), generator=gen).tolist()
        samples = [
            Sample(
                prompt_id=p,
                sample_idx=i,
                completion_token_ids=torch.randint(100, 40000, (completion,), generator=gen).tolist(),
                logprobs=[-1.0] * completion,
            )
            for i in range(g)
        ]
        rewards = [1.0] * g if p < flat else [float(i % 2) for i in range(g)]
        groups.append(Group(p, 0, prompt, samples, rewards, "bench"))
    return groups


def matmul_bound(
    model: torch.nn.Module, tokens: int, completion_tokens: int, micro_batches: int
) -> tuple[float, float]:
    """(seconds, GFLOP/s): the step's matmul FLOPs at the box's rate for one micro-batch's MLP product. Every
    linear layer runs on all `tokens` (the packed micro-batches' tokens), the tied vocabulary projection on the
    completion positions only; backward is twice forward (the input's gradient and the weight's)."""
    head = model.get_output_embeddings().weight
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear) and m.weight is not head)
    flops = 3 * 2 * (linear * tokens + head.numel() * completion_tokens)
    cfg = model.config
    rows = tokens // micro_batches
    a, w = torch.randn(rows, cfg.hidden_size), torch.randn(cfg.hidden_size, cfg.intermediate_size)
    torch.mm(a, w)  # warm-up
    t0, reps = time.perf_counter(), 20
    for _ in range(reps):
        torch.mm(a, w)
    rate = 2 * rows * cfg.hidden_size * cfg.intermediate_size * reps / (time.perf_counter() - t0)
    return flops / rate, rate / 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--completion-tokens", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--flat-groups", type=int, default=0)
    args = ap.parse_args()
    trainer = Trainer(
        prepare_default_model(), lr=1e-6, clip_eps=0.2, is_cap=3.0, kl_coef=0.0, max_grad_norm=1.0, micro_batch=16
    )
    groups = make_groups(args.prompts, args.group_size, args.completion_tokens, args.flat_groups)
    trainer.step(groups)  # warm-up
    echo2, whole, full = "packed, shared prompts (echo2)", "packed, each sequence whole", "padded, full projection"
    every = "echo2, flat groups run too"
    original = Trainer._token_logp
    variants = [(echo2, original, True, True), (whole, original, False, True)]
    variants += [(full, full_projection_logp, False, True)]
    variants += [(every, original, True, False)] if args.flat_groups else []
    times: dict[str, list[float]] = {v[0]: [] for v in variants}
    for _ in range(args.repeats):
        for name, fn, share, skip in variants:
            Trainer._token_logp = fn
            trainer.policy.share_prompts, trainer.skip_flat = share, skip
            t0 = time.perf_counter()
            trainer.step(groups)
            times[name].append(time.perf_counter() - t0)
    Trainer._token_logp = original
    med = {k: statistics.median(v) for k, v in times.items()}
    n = args.prompts * args.group_size
    print(
        f"batch: {n} sequences x ({PROMPT_TOKENS} prompt + {args.completion_tokens} completion) tokens, "
        f"torch threads {torch.get_num_threads()}, autocast bf16 {trainer.autocast}"
    )
    for k, v in med.items():
        print(f"  {k:30s} T_train median {v:6.2f} s  ({', '.join(f'{t:.2f}' for t in times[k])})")
    print(f"  speed-up of shared prompts vs each sequence whole: {med[whole] / med[echo2]:.2f}x")
    print(f"  speed-up vs the full projection baseline: {med[full] / med[echo2]:.2f}x")
    if args.flat_groups:
        left = (args.prompts - args.flat_groups) / args.prompts
        print(
            f"  speed-up of skipping {args.flat_groups} flat group(s) of {args.prompts} vs running them: "
            f"{med[every] / med[echo2]:.2f}x (at most {1 / left:.2f}x: {left:.0%} of the tokens are trained)"
        )
    trained = args.prompts - args.flat_groups  # groups
    rows = trained * args.group_size
    tokens = trained * PROMPT_TOKENS + rows * args.completion_tokens
    micro_batches = -(-rows // trainer.micro_batch)
    bound, gflops = matmul_bound(trainer.model, tokens, rows * args.completion_tokens, micro_batches)
    print(
        f"  matmul lower bound of echo2's step: {bound:.2f} s ({tokens} tokens at {gflops:.1f} GFLOP/s, this box's "
        f"MLP matmul rate); step / bound {med[echo2] / bound:.2f}x"
    )


if __name__ == "__main__":
    main()
