"""How a step's sequences are spread over ranks and cut into micro-batches. Pure Python, no torch.

A step is one token-level mean over every completion token of the batch, however the sequences are split:
each micro-batch's loss is weighted by its share of the batch's completion tokens (`trainer.py`). So the split
only decides memory and balance, and both are about tokens, not sequence counts: a 16k-token reasoning trace
costs as much as a hundred short answers.
"""

from __future__ import annotations

from collections.abc import Sequence


def balance(lengths: Sequence[int], world: int) -> list[list[int]]:
    """Sequence indices per rank, with the token counts as even as greedy allows: longest first, each to the
    rank with the fewest tokens so far (ties to the lowest rank). Every rank computes the same split."""
    ranks: list[list[int]] = [[] for _ in range(world)]
    load = [0] * world
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(world), key=lambda r: (load[r], r))
        ranks[r].append(i)
        load[r] += lengths[i]
    return [sorted(r) for r in ranks]


def micro_batches(
    indices: Sequence[int],
    lengths: Sequence[int],
    max_tokens: int,
    max_seqs: int,
    groups: Sequence[int] | None = None,
    packed: bool = False,
    prompt_lengths: Sequence[int] | None = None,
) -> list[list[int]]:
    """`indices` cut into micro-batches of at most `max_seqs` sequences whose size stays within `max_tokens`
    (0 = no token budget): padded, count x longest; `packed`, the tokens of their packed row, which with `groups`
    and `prompt_lengths` counts each group's prompt once (a packed micro-batch runs a shared prompt once,
    `packing.py`). A sequence longer than the budget goes alone.

    Sequences are taken longest first, so those padded together have similar lengths. With `groups` (a group
    id per sequence, e.g. the prompt it answers) a group's sequences are taken one after another, groups
    longest first, so a micro-batch holds whole groups where the limits allow: the trainer runs a prompt
    shared within a micro-batch once (`trainer.py`)."""
    if groups is None:
        order = sorted(indices, key=lambda i: (-lengths[i], i))
    else:
        group_len: dict[int, int] = {}
        for i in indices:
            group_len[groups[i]] = max(group_len.get(groups[i], 0), lengths[i])
        order = sorted(indices, key=lambda i: (-group_len[groups[i]], groups[i], -lengths[i], i))
    out: list[list[int]] = []
    current: list[int] = []
    for i in order:
        if packed:
            size = _packed_size(current + [i], lengths, groups, prompt_lengths)
        else:
            size = (len(current) + 1) * max([lengths[j] for j in current] + [lengths[i]])
        fits = len(current) < max_seqs and (max_tokens <= 0 or size <= max_tokens)
        if current and not fits:
            out.append(current)
            current = []
        current.append(i)
    if current:
        out.append(current)
    return out


def _packed_size(
    members: list[int], lengths: Sequence[int], groups: Sequence[int] | None, prompt_lengths: Sequence[int] | None
) -> int:
    """Tokens of a packed micro-batch: every sequence's length, less the repeats of a group's shared prompt."""
    total = sum(lengths[j] for j in members)
    if groups is None or prompt_lengths is None:
        return total
    seen: set[int] = set()
    for j in members:
        if groups[j] in seen:
            total -= prompt_lengths[j]
        seen.add(groups[j])
    return total


def mini_batches(groups: int, n: int) -> list[list[int]]:
    """`groups` group indices cut into `n` runs of consecutive groups, one optimizer step each, as even as whole
    groups allow (the first ones take the remainder); never an empty one: fewer than `n` if there are fewer
    groups. A group stays whole, so its advantages (taken over the group) are the batch's."""
    n = max(1, min(n, groups))
    size, extra = divmod(groups, n)
    out, start = [], 0
    for k in range(n):
        end = start + size + (k < extra)
        out.append(list(range(start, end)))
        start = end
    return out
