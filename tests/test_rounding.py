"""The fp32 master against the bf16 weights it publishes (`echo2cli/learner/rounding.py`)."""

import torch

from echo2cli.learner.rounding import dither_master, dithered

INF = torch.tensor(float("inf"), dtype=torch.bfloat16)


def grid_weights(n: int = 1 << 18) -> torch.Tensor:
    """Weights as a model shipped in bf16 loads them: fp32 values on the bf16 grid."""
    return (torch.randn(n, generator=torch.Generator().manual_seed(0)) * 0.05).bfloat16().float()


def ulp(x: torch.Tensor) -> torch.Tensor:
    b = x.bfloat16()
    return torch.nextafter(b, INF).float() - b.float()


def test_a_dithered_weight_rounds_to_the_same_bf16_value():
    x = torch.cat([grid_weights(), torch.tensor([0.0, -0.0, 1.0, -1.0, 0.5, 2.0**-130, 3e38, float("inf")])])
    for u in (torch.zeros(x.shape), torch.full(x.shape, 0.999999), torch.rand(x.shape)):
        moved = dithered(x, u)
        assert torch.equal(moved.bfloat16(), x.bfloat16())
    assert (dithered(x, torch.rand(x.shape)) != x).float().mean() > 0.99  # almost every master moved off the grid


def test_from_the_grid_a_small_step_is_lost_to_rounding_and_from_a_dithered_master_it_is_kept_on_average():
    x = grid_weights()
    step = 0.1 * ulp(x)  # ten times smaller than an ulp, as an AdamW step at lr 1e-5 is for a weight of 0.05

    def published_move(master):
        return ((master + step).bfloat16().float() - master.bfloat16().float()) / ulp(x)

    assert published_move(x).abs().max() == 0  # the dead zone: nothing reaches the published weights
    dith = dithered(x, torch.rand(x.shape, generator=torch.Generator().manual_seed(1)))
    moved = published_move(dith)
    assert set(moved.unique().tolist()) == {0.0, 1.0}  # a whole ulp, or nothing
    assert 0.09 < moved.mean() < 0.11  # on average the step itself (0.99 of it: the interval is shrunk by 1 %)


def test_in_fp16_a_dithered_weight_keeps_its_fp16_value_and_a_small_step_moves_it_an_eighth_as_coarsely():
    """`--wire-dtype fp16`: the same dither in fp16's finer intervals; a step of a tenth of a bf16 ulp moves an
    fp16 weight by whole fp16 ulps, eight times smaller, with the same mean."""
    x = grid_weights()
    x = x[x.abs() >= 2**-14]  # fp16's normal range: 99.9 % of weights of scale 0.05
    step = 0.1 * ulp(x)
    dith = dithered(x, torch.rand(x.shape, generator=torch.Generator().manual_seed(1)), torch.float16)
    assert torch.equal(dith.half(), x.half())
    moved = ((dith + step).half().float() - dith.half().float()) / ulp(x)
    assert (moved.abs() <= 0.125 + 1e-6).float().mean() > 0.999  # one fp16 ulp, an eighth of bf16's (but at 2^k)
    assert 0.09 < moved.mean() < 0.11
    bf16_moved = ((dithered(x, torch.rand(x.shape), torch.bfloat16) + step).bfloat16().float() - x) / ulp(x)
    assert moved.var() < bf16_moved.var() / 6  # an eighth of the variance, up to the ulp's steps at powers of two


def test_dither_master_is_seeded_and_keeps_the_published_weights():
    params = [torch.nn.Parameter(grid_weights(1000)), torch.nn.Parameter(grid_weights(10).reshape(2, 5))]
    before = [p.detach().clone() for p in params]
    dither_master(params, seed=3)
    again = [torch.nn.Parameter(b.clone()) for b in before]
    dither_master(again, seed=3)
    assert all(torch.equal(p, q) for p, q in zip(params, again, strict=True))
    assert all(torch.equal(p.bfloat16(), b.bfloat16()) for p, b in zip(params, before, strict=True))
    assert not torch.equal(params[0], before[0])


def test_two_parameters_of_one_shape_get_independent_offsets():
    """The same projection in two layers must not share one offset pattern: one stream runs through them all."""
    w = grid_weights(1000)
    params = [torch.nn.Parameter(w.clone()), torch.nn.Parameter(w.clone())]
    dither_master(params, seed=0)
    assert (params[0] != params[1]).float().mean() > 0.99
