"""The trainer computes with the weights it publishes.

A version goes to the workers in bf16 or fp16 (`Trainer.weights_image`; bf16 in what follows, fp16 at the end);
the trainer keeps its weights in fp32 for AdamW.
If its forward pass read the fp32 weights, the policy it scores and moves (pi_theta) would not be the one the
engines sample from (mu: the same weights rounded to bf16), not even at staleness 0. An AdamW step moves each
weight by about lr, and for most weights that is less than a bf16 ulp (the ulp of a weight of 0.05 is 2.4e-4).
Rounding then drops the step from some weights and makes it a whole ulp on others, and the two policies part.
Measured on the default model without bf16 compute (docs/BENCHMARKS.md): at staleness 0, after one step at
lr 2e-4, end-of-answer tokens a worker had sampled at probability 0.5-0.94 had e^-9 to e^-17 in the trainer.

So each step's forward and backward passes run on the rounded values (`as_published`). The fp32 master is put
aside, the weights are rounded in place, and the master is put back before the optimizer step. The step then
applies to the master a gradient taken at the rounded point: what mixed precision does for the layers autocast
casts. Only the parameters the forward reads at fp32 need this (`read_at_fp32`). Without bf16 compute, that is
all of them. With it (autocast, or FSDP2's bf16 layers), the decoder layers' linear layers are cast already, by
the same round-to-nearest-even; the embeddings, the norms and an untied head are not.

Rounding alone leaves a dead zone at the start. A model shipped in bf16 loads with every fp32 master weight on the
bf16 grid, at the middle of its rounding interval, so the published weight moves only once the master has moved
half an ulp: 1.2e-4 for a weight of 0.05, twelve steps of lr 1e-5 in one direction. Until then most steps are
lost to the policy. `dither_master` moves each master weight, once, to a random point inside its own rounding
interval. Version 0 is unchanged (every weight still rounds to its bf16 value); from there a master move of d
moves the published weight by one ulp with probability d / ulp, so the policy moves by d on average, as the
fp32 master does, from the first step.

On average, not in each step: each weight's published move is a whole ulp or nothing, a variance of about
d * ulp around d. With bf16's ulp, 12x a step of lr 2e-5 for a weight of 0.05, that noise is 3.5x the step
itself. fp16 has the same 2 bytes and three more mantissa bits: an eighth of bf16's ulp (3.1e-5 at 0.05), so
the same step reaches the published policy with an eighth of the variance. Its range (normal from 6.1e-5 to
65504) holds a model's weights, and the few smaller weights lose bits only below 6.1e-5 (absolute error under
3e-8). The version's dtype is the learner's `--wire-dtype` (bf16 by default), which every function here takes:
fp16 only where the learner computes in fp32, since bf16 compute (autocast, FSDP2's bf16 layers) would round the
layers' weights to bf16 again; the workers' engines then compute in fp16 on CUDA and in fp32 on a CPU
(`hardware.engine_dtype`). On the default task, six seeds could not tell fp16 from bf16 in held-out accuracy
(docs/BENCHMARKS.md, "fp16 versions against bf16"), so bf16 stays the default.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

CHUNK = 1 << 24  # elements per pass of `dither_master`: bounds its temporaries (~0.4 GB at 5 fp32 copies)


def read_at_fp32(model: torch.nn.Module, bf16_compute: bool) -> list[torch.nn.Parameter]:
    """The trainable parameters the forward pass reads at fp32: all of them, or with bf16 compute all but the
    decoder layers' linear layers (adapters included)."""
    cast: set[int] = set()
    if bf16_compute:
        for layer in model.get_decoder().layers:
            for module in layer.modules():
                if isinstance(module, torch.nn.Linear):
                    cast.update(id(p) for p in module.parameters(recurse=False))
    return [p for p in model.parameters() if p.requires_grad and id(p) not in cast]


@contextlib.contextmanager
def as_published(params: list[torch.nn.Parameter], dtype: torch.dtype = torch.bfloat16) -> Iterator[None]:
    """Inside, `params` hold their values rounded to `dtype`, the wire dtype (in their own dtype); on leaving,
    their fp32 values again. Gradients taken inside stay in `.grad`. Costs one copy of `params` while inside."""
    with torch.no_grad():
        masters = [p.detach().clone() for p in params]
        for p in params:
            p.copy_(p.to(dtype))
    try:
        yield
    finally:
        with torch.no_grad():
            for p, master in zip(params, masters, strict=True):
                p.copy_(master)


def dither_master(params: list[torch.nn.Parameter], seed: int, dtype: torch.dtype = torch.bfloat16) -> None:
    """Move each fp32 master weight to a uniformly random point strictly inside the interval of values that round
    to its value in `dtype`, the wire dtype (the same value: the published weights do not change). Under FSDP2,
    each rank moves its own shard, with its own stream. One stream runs on through all parameters, so two
    parameters of one shape (the same projection in two layers) get independent offsets, not the same pattern."""
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    generators: dict[torch.device, torch.Generator] = {}  # one stream per device, on through every parameter
    with torch.no_grad():
        for p in params:
            local = p.to_local() if hasattr(p, "to_local") else p  # a DTensor's shard
            if local.device not in generators:
                generators[local.device] = torch.Generator(device=local.device).manual_seed(seed * 1_000_003 + rank)
            gen = generators[local.device]
            for part in local.view(-1).split(CHUNK):
                part.copy_(dithered(part, torch.rand(part.shape, generator=gen, device=part.device), dtype))


def dithered(x: torch.Tensor, u: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """`x` rounded to `dtype` (bf16 or fp16), then moved by a fraction `u` (in [0, 1)) across the span between the
    midpoints to its neighbours in `dtype`, shrunk by 1 % so that no point is a tie; the result rounds back to
    the same value."""
    b = x.to(dtype)
    inf = torch.tensor(float("inf"), dtype=dtype, device=x.device)
    centre = b.float()
    low = (torch.nextafter(b, -inf).float() - centre) / 2
    high = (torch.nextafter(b, inf).float() - centre) / 2
    offset = (low + (high - low) * u) * 0.99
    return centre + torch.where(torch.isfinite(offset), offset, 0.0)
