"""Packed micro-batches: a micro-batch's sequences laid end to end in one row, no pad tokens, each prompt once.

The G samples of a GRPO group share their prompt. A micro-batch is packed as

    [prompt_1 | prompt_2 | ... | prompt_U | completion_1 | completion_2 | ... | completion_N]

with every distinct prompt once and every completion after all prompts. Position ids restart with each prompt and
continue from its prompt's end in each of its completions, so rotary embeddings see what a plain pass sees.
Attention (`packed_attention`, registered with transformers as PACKED) is two causal passes per layer: the
prompts among themselves, then each completion's queries against its row's [prompt | completion] keys, its
prompt's keys and values gathered in front of its completion's (`kv_index`). Gradients reach the prompt through
every completion that read it. The layers' matmuls, most of the FLOPs, run once per distinct prompt. The result
equals one plain causal pass per (prompt + completion) up to float rounding (tests/test_packing.py checks
log-probs and gradients against padded rows in fp32).

On CUDA the passes are flash-attention varlen kernels (`torch.nn.attention.varlen`, torch >= 2.10): no padding,
no mask tensor, no work outside a sequence. The completions' queries are taken as they lie in the packed row,
fewer than their span's keys, which is right where the kernel aligns a causal mask bottom-right, as flash does
(COMPLETION_QUERIES); a self-test at the first step checks that against SDPA, and where it fails, each span's
queries run too, as many as its keys (SPAN_QUERIES, right under either alignment), of which only the
completion's outputs are kept. Elsewhere (CPU, an older torch, or a kernel that fails its self-test) the passes
are two SDPA calls per layer over right-padded rows: the prompts causal, then each completion's queries alone
against its span's keys under a mask (`Pack.span_mask`).

Under `--compile` the attention runs outside the compiled layer graph (`torch.compiler.disable`), so that graph
depends only on the row's length, symbolic from the start: micro-batches of any layout run one graph.

Everything the layout needs is computed here from the rows' Python lists, so the trainer never reads a device
tensor back to plan a micro-batch.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

PACKED = "echo2_packed"  # the attention implementation's name in transformers' AttentionInterface


class Pack:
    """One micro-batch packed (module docstring). Tensors on the trainer's device:

    input_ids, position_ids: [1, T]; T = Tp prompt tokens + the completions' tokens.
    pick: [M] packed positions whose hidden state predicts a loss token, targets: [M] those tokens,
    slot: [M] where each lands in an [N, C] completion-aligned grid (row * C + completion position).
    mask, behaviour: [N, C] the policy mask and the engine's log-probs, completion-aligned.
    Attention (`_plan_attention`): cu_prompt / max_prompt over the first Tp tokens; kv_index, the packed positions
    of each row's [prompt | completion] span, one after another, with cu_k / max_k over them, and
    span_completions, the completion tokens' places among them; the same sequences right-padded for SDPA."""

    def __init__(self, rows: Sequence[tuple], device: torch.device, share_prompts: bool = True) -> None:
        self.rows = rows
        prompts: dict[Any, list[int]] = {}  # each distinct prompt (each row's own, without sharing) in first-seen order
        keys = [tuple(row[0]) if share_prompts else r for r, row in enumerate(rows)]
        for key, row in zip(keys, rows, strict=True):
            prompts.setdefault(key, list(row[0]))
        index = {key: u for u, key in enumerate(prompts)}
        owner = [index[key] for key in keys]
        prompt_lens = [len(p) for p in prompts.values()]
        prompt_at = _offsets(prompt_lens)
        self.n_prompt_tokens = tp = prompt_at[-1]
        comp_lens = [len(row[1]) for row in rows]
        comp_at = [tp + a for a in _offsets(comp_lens)]
        n, width = len(rows), max(comp_lens)
        ids: list[int] = [t for p in prompts.values() for t in p]
        positions: list[int] = [i for length in prompt_lens for i in range(length)]
        pick: list[int] = []
        targets: list[int] = []
        slot: list[int] = []
        kv_index: list[int] = []
        mask = torch.zeros((n, width))
        behaviour = torch.zeros((n, width))
        for r, (row, u) in enumerate(zip(rows, owner, strict=True)):
            completion, logprobs = row[1], row[2]
            policy = row[3] if len(row) > 3 and row[3] is not None else [1] * len(completion)
            p_len, start = prompt_lens[u], comp_at[r]
            ids += completion
            positions += range(p_len, p_len + len(completion))
            kv_index += [*range(prompt_at[u], prompt_at[u] + p_len), *range(start, start + len(completion))]
            for j, (token, m) in enumerate(zip(completion, policy, strict=True)):
                if m:  # token j is predicted from the prompt's last position (j = 0) or completion token j - 1
                    pick.append(prompt_at[u] + p_len - 1 if j == 0 else start + j - 1)
                    targets.append(token)
                    slot.append(r * width + j)
            mask[r, : len(completion)] = torch.tensor(policy, dtype=mask.dtype)
            behaviour[r, : len(completion)] = torch.tensor(logprobs, dtype=behaviour.dtype)

        def on(values: list[int] | list[list[int]], dtype: torch.dtype = torch.long) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

        self.input_ids, self.position_ids = on(ids)[None], on(positions)[None]
        self.pick, self.targets, self.slot = on(pick), on(targets), on(slot)
        self.mask, self.behaviour = mask.to(device, non_blocking=True), behaviour.to(device, non_blocking=True)
        self.shape = (n, width)
        self.loss_tokens = len(pick)
        self.varlen: str | None = None  # the flash varlen passes' mode (`varlen_mode`), set by the scorer
        self._plan_attention(on, prompt_lens, prompt_at, owner, comp_lens, comp_at, kv_index)

    def _plan_attention(
        self,
        on: Any,
        prompt_lens: list[int],
        prompt_at: list[int],
        owner: list[int],
        comp_lens: list[int],
        comp_at: list[int],
        kv_index: list[int],
    ) -> None:
        """Offsets for the varlen kernel, and the same sequences right-padded for SDPA (class docstring)."""
        key_lens = [prompt_lens[u] + c for u, c in zip(owner, comp_lens, strict=True)]
        key_at = _offsets(key_lens)
        self.cu_prompt, self.max_prompt = on(prompt_at, torch.int32), max(prompt_lens)
        self.cu_k, self.max_k = on(key_at, torch.int32), max(key_lens)
        self.cu_c, self.max_c = on(_offsets(comp_lens), torch.int32), max(comp_lens)
        self.kv_index = on(kv_index)
        spans = zip(key_at[1:], comp_lens, strict=True)
        self.span_completions = on([i for end, c in spans for i in range(end - c, end)])
        prompt_pad, prompt_keep = _pad_rows(
            [list(range(a, b)) for a, b in zip(prompt_at, prompt_at[1:], strict=False)], 0
        )
        span_pad, _ = _pad_rows([kv_index[a:b] for a, b in zip(key_at, key_at[1:], strict=False)], 0)
        completion_pad, completion_keep = _pad_rows(
            [list(range(a, a + c)) for a, c in zip(comp_at, comp_lens, strict=False)], 0
        )
        self.prompt_pad, self.prompt_keep = on(prompt_pad), on(prompt_keep)
        self.span_pad, self.completion_pad, self.completion_keep = on(span_pad), on(completion_pad), on(completion_keep)
        self._row_prompt = on([prompt_lens[u] for u in owner])
        self._row_keys = on(key_lens)
        self._span_mask: torch.Tensor | None = None

    @property
    def span_mask(self) -> torch.Tensor:
        """[N, 1, C, K]: completion query j of row r sees span keys 0 .. P_r + j (its prompt's P_r tokens and its
        own first j + 1), never past its span; a padded query sees the same, so no row is empty (no NaN)."""
        if self._span_mask is None:
            keys = torch.arange(self.span_pad.shape[1], device=self.span_pad.device)
            queries = torch.arange(self.completion_pad.shape[1], device=self.span_pad.device)
            limit = self._row_prompt[:, None, None] + queries[None, :, None]
            self._span_mask = ((keys <= limit) & (keys < self._row_keys[:, None, None]))[:, None]
        return self._span_mask

    @property
    def tokens(self) -> int:
        """Tokens in the packed row: what the layers compute on."""
        return int(self.input_ids.shape[1])


def _pad_rows(rows: list[list[int]], fill: int) -> tuple[list[list[int]], list[int]]:
    """Sequences of packed positions right-padded to the longest (each row's last position repeated: a padded
    position's output is dropped, and in a causal pass its key is seen only by padded queries), and the flat
    places of the real positions' outputs."""
    longest = max(len(r) for r in rows)
    pad = [r + [r[-1] if r else fill] * (longest - len(r)) for r in rows]
    keep = [i * longest + j for i, r in enumerate(rows) for j in range(len(r))]
    return pad, keep


def _offsets(lengths: Sequence[int]) -> list[int]:
    """[0, l0, l0 + l1, ...]: the start of each segment and the end of the last."""
    out = [0]
    for length in lengths:
        out.append(out[-1] + length)
    return out


@torch.compiler.disable  # run eagerly inside a compiled layer: no guard on any micro-batch's layout (`Pack`)
def packed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    echo2_pack: Pack | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: query [1, H, T, D], key and value [1, Hkv, T, D] of a packed row →
    ([1, T, H, D], None). Without a Pack (a plain call on this model) it is SDPA as transformers runs it."""
    if echo2_pack is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    if query.shape[0] != 1:
        raise ValueError(f"a packed micro-batch is one row, got a batch of {query.shape[0]}")
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [T, heads, D]
    if q.is_cuda and torch.is_autocast_enabled("cuda"):  # SDPA would be cast by autocast; a custom op is not
        q, k, v = (x.to(torch.get_autocast_dtype("cuda")) for x in (q, k, v))
    half = q.dtype in (torch.bfloat16, torch.float16) and q.dtype == k.dtype == v.dtype
    if echo2_pack.varlen and half:  # decided before the layers (`TokenLogp`): no lookup inside a compiled layer
        out = _varlen_passes(q, k, v, echo2_pack, scaling, echo2_pack.varlen)
    else:
        out = _sdpa_passes(q, k, v, echo2_pack, scaling)
    return out[None], None


def _sdpa_passes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pack: Pack, scale: float | None) -> torch.Tensor:
    """The two passes as two SDPA calls over right-padded sequences ([T, heads, D] in and out), exact on any
    device: the prompts causal, then each completion's queries alone against its [prompt | completion] keys
    under `Pack.span_mask` (the prompt's queries need not run again: on CPU that is most of the work saved)."""
    k, v = _repeat_kv(k, v, q.shape[1])  # SDPA's enable_gqa rules out CUDA's flash kernel in some versions
    prompts = _padded(q, k, v, pack.prompt_pad, pack.prompt_pad, None, pack.prompt_keep, scale)
    completions = _padded(q, k, v, pack.completion_pad, pack.span_pad, pack.span_mask, pack.completion_keep, scale)
    return torch.cat([prompts, completions])


def _padded(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    queries: torch.Tensor,
    keys: torch.Tensor,
    mask: torch.Tensor | None,
    keep: torch.Tensor,
    scale: float | None,
) -> torch.Tensor:
    """SDPA over right-padded sequences: the packed positions `queries` ([n, Lq]) against `keys` ([n, Lk]),
    causal where `mask` is None (Lq = Lk), else under `mask`; the outputs at the flat places `keep`."""
    n, length = queries.shape
    qs = q[queries].transpose(1, 2)  # [n, heads, Lq, D]
    ks, vs = (x[keys].transpose(1, 2) for x in (k, v))
    out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, is_causal=mask is None, scale=scale)
    return out.transpose(1, 2).reshape(n * length, q.shape[1], q.shape[2]).index_select(0, keep)


def _varlen_passes(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pack: Pack, scale: float | None, mode: str
) -> torch.Tensor:
    """The two passes as flash varlen kernels ([T, heads, D] in and out). Mode COMPLETION_QUERIES: the completions'
    queries as they lie in the packed row (no gather, no prompt query run again) against their spans' keys, right
    where the kernel aligns a causal mask bottom-right as flash does (query j of a completion after a P-token
    prompt sees keys 0 .. P + j). Mode SPAN_QUERIES: each span's queries too, as many as its keys (right under
    either alignment), of which only the completion's outputs are kept."""
    tp = pack.n_prompt_tokens
    prompts = _varlen_causal(
        q[:tp], k[:tp], v[:tp], pack.cu_prompt, pack.cu_prompt, pack.max_prompt, pack.max_prompt, scale
    )
    rk, rv = (x.index_select(0, pack.kv_index) for x in (k, v))
    if mode == COMPLETION_QUERIES:
        completions = _varlen_causal(q[tp:], rk, rv, pack.cu_c, pack.cu_k, pack.max_c, pack.max_k, scale)
        return torch.cat([prompts, completions])
    rq = q.index_select(0, pack.kv_index)
    spans = _varlen_causal(rq, rk, rv, pack.cu_k, pack.cu_k, pack.max_k, pack.max_k, scale)
    return torch.cat([prompts, spans.index_select(0, pack.span_completions)])


def _varlen_causal(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    scale: float | None,
) -> torch.Tensor:
    """Causal varlen attention (flash); keys and values with fewer heads than the queries are repeated unless the
    kernel takes them as they are."""
    fn, params = _varlen()  # type: ignore[misc]
    extra: dict[str, Any] = {}
    if k.shape[1] != q.shape[1] and "enable_gqa" in params:
        extra["enable_gqa"] = True
    else:
        k, v = _repeat_kv(k, v, q.shape[1])
    if "is_causal" in params:
        extra["is_causal"] = True
    else:
        extra["window_size"] = (-1, 0)
    if "scale" in params:
        extra["scale"] = scale
    return fn(q.contiguous(), k.contiguous(), v.contiguous(), cu_q, cu_k, max_q, max_k, **extra)


def _repeat_kv(k: torch.Tensor, v: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped-query keys and values ([T, kv heads, D]) repeated to the query heads: head h reads kv head
    h // (heads / kv heads), as transformers' repeat_kv does."""
    if k.shape[1] == heads:
        return k, v
    r = heads // k.shape[1]
    return k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1)


COMPLETION_QUERIES, SPAN_QUERIES = "completion queries", "span queries"  # `_varlen_passes`' modes
_VARLEN: list[Any] = []
_CHECKED: dict[tuple, str | None] = {}


def _varlen() -> tuple[Any, set[str]] | None:
    """torch's flash varlen attention and the names of its parameters, or None where this torch has none."""
    if not _VARLEN:
        try:
            from torch.nn.attention.varlen import varlen_attn
        except ImportError:
            _VARLEN.append(None)
        else:
            _VARLEN.append((varlen_attn, set(inspect.signature(varlen_attn).parameters)))
    return _VARLEN[0]


def varlen_mode(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int) -> str | None:
    """How the varlen kernel runs here, forward and backward, agreeing with the SDPA passes (fp32) on a small
    packed case: COMPLETION_QUERIES where its causal mask is aligned bottom-right (what a completion's queries
    against its span's longer keys need), else SPAN_QUERIES, else None: the SDPA passes run, and a warning says
    why (an older torch, a kernel that does not build). Checked once per device, dtype and head layout."""
    key = (str(device), dtype, heads, kv_heads)
    if key not in _CHECKED:
        _CHECKED[key] = _self_test(device, dtype, heads, kv_heads)
    return _CHECKED[key]


def _self_test(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int) -> str | None:
    import warnings

    if _varlen() is None or dtype not in (torch.bfloat16, torch.float16):
        return None
    rows = [([1, 2, 3, 4, 5], [6, 7, 8], [0.0] * 3), ([1, 2, 3, 4, 5], [9, 10], [0.0] * 2), ([4, 2], [7], [0.0])]
    pack = Pack(rows, device)
    g = torch.Generator(device=device).manual_seed(0)
    qkv = [torch.randn(pack.tokens, h, 64, device=device, generator=g) for h in (heads, kv_heads, kv_heads)]
    exact = [x.clone().requires_grad_() for x in qkv]  # the reference in fp32
    want = _sdpa_passes(exact[0], exact[1], exact[2], pack, None)
    want.square().sum().backward()
    why = ""
    for mode in (COMPLETION_QUERIES, SPAN_QUERIES):
        try:
            fast = [x.to(dtype).requires_grad_() for x in qkv]
            got = _varlen_passes(fast[0], fast[1], fast[2], pack, None, mode)
            got.float().square().sum().backward()
        except Exception as exc:  # a kernel that does not exist for this device or dtype raises its own kind
            why = f"flash varlen unusable here ({exc!s:.200})"
            break
        errors = [_relative(got, want)] + [_relative(a.grad, b.grad) for a, b in zip(fast, exact, strict=True)]
        if max(errors) <= 0.02:  # bf16 rounding gives ~0.4 %; a wrong mask or head layout gives tens of percent
            return mode
        why = f"flash varlen differs from SDPA by {max(errors):.1%} on a test case"
    warnings.warn(f"packed attention: {why}; per-sequence SDPA instead", stacklevel=3)
    return None


def _relative(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    """||a - b|| / ||b||; a missing gradient counts as wholly wrong."""
    if a is None or b is None:
        return 1.0
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp(min=1e-12))


def kernel(device: torch.device | str) -> str:
    """Which packed attention ran on `device`: "flash varlen (<mode>)" or "sdpa, padded rows"."""
    modes = [mode for key, mode in _CHECKED.items() if key[0] == str(device) and mode]
    return f"flash varlen ({modes[0]})" if modes else "sdpa, padded rows"


def use_packed_attention(*models: torch.nn.Module | None) -> None:
    """Register `packed_attention` with transformers and make it each model's attention (None: skipped). A call
    without a Pack still runs SDPA, so the model behaves as before for anything else. No mask is built for it:
    transformers builds masks only for the implementations it knows."""
    from transformers import AttentionInterface

    AttentionInterface.register(PACKED, packed_attention)
    for model in models:
        if model is not None:
            model.set_attn_implementation(PACKED)
