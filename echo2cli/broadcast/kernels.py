"""The delta coder's inner loops, compiled (numba): a counting sort by exponent, in two passes over a chunk.

A chunk's words are visited in order of their bf16 exponent in the base, file order within one exponent
(delta.py). numpy gets there only through a stable argsort of the whole chunk and gathers through it, and the
sort was most of the delta coder's time. Neither side needs the whole order:

    encode   `changes_in_visit_order`: the changed words' places in the visit order, and the step of each
             (`position(new) - position(old)`); about 5 % of the words
    rebuild  `patch`: move the words at the visit places the delta names by their steps, in place

With 256 exponents, one pass counts the words of each (so each exponent's first visit place is known) and a
second pass walks the chunk keeping one running count per exponent, which is each word's visit place; neither
writes anything the size of the chunk. A 1.19 GB version's encode on one core: 3.35 s, where numpy's sort took
5.25 s (`scripts/bench_publish.py`, docs/BENCHMARKS.md).

`visit_order`, `position` and `from_position` (numpy) are the definitions; tests/test_delta.py holds the loops
to them word for word. Compiled `nogil`, so the delta coder's threads run them on every core; the first call
in a process compiles them (about a second; cached beside this file where it is writable). Where numba is
missing (a host that installed only some of the dependencies), the same definitions do the work, slower.
"""

from __future__ import annotations

import numpy as np

try:
    from numba import njit

    COMPILED = True
except ImportError:  # pragma: no cover - numba is a dependency; see the module's docstring
    COMPILED = False

EXPONENTS = 256


def visit_order(words: np.ndarray) -> np.ndarray:
    """The order a chunk's words are coded in: by their bf16 exponent in the base, file order within one."""
    return np.argsort(((words >> 7) & 0xFF).astype(np.uint8), kind="stable")  # 8-bit keys: radix sort


def position(words: np.ndarray) -> np.ndarray:
    """bf16 bit patterns in value order, as int32: +x at its magnitude bits, -x at -(magnitude bits) - 1."""
    w: np.ndarray = words.astype(np.int32)
    magnitude = w & 0x7FFF
    return np.where(w >> 15 == 1, -magnitude - 1, magnitude)


def _changes_numpy(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    order = visit_order(a)
    places = np.flatnonzero((a != b)[order])
    at = order[places]
    return places, position(b[at]) - position(a[at])


def from_position(pos: np.ndarray) -> np.ndarray:
    """The inverse of `position`."""
    return np.where(pos < 0, 0x8000 | (-pos - 1), pos).astype(np.uint16)


def _patch_numpy(words: np.ndarray, places: np.ndarray, steps: np.ndarray) -> bool:
    at = visit_order(words)[places]
    pos = position(words[at]) + steps
    if pos.size and (pos.min() < -0x8000 or pos.max() > 0x7FFF):
        return False
    words[at] = from_position(pos)
    return True


def _first_places_loops(words: np.ndarray) -> np.ndarray:
    """Each exponent's first place in the visit order (words with a smaller exponent come first)."""
    counts: np.ndarray = np.zeros(EXPONENTS, np.int64)
    for i in range(words.size):
        counts[(words[i] >> 7) & 0xFF] += 1
    first: np.ndarray = np.zeros(EXPONENTS, np.int64)
    for k in range(1, EXPONENTS):
        first[k] = first[k - 1] + counts[k - 1]
    return first


def _position_of(word: int) -> int:
    magnitude = word & 0x7FFF
    return -magnitude - 1 if word >> 15 else magnitude


def _changes_loops(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(places, steps): where the words that differ between `a` and `b` come in `a`'s visit order (ascending),
    and how far each moved (`position(b) - position(a)`)."""
    n = a.size
    counts: np.ndarray = np.zeros(EXPONENTS, np.int64)
    changed: np.ndarray = np.zeros(EXPONENTS, np.int64)
    for i in range(n):
        k = (a[i] >> 7) & 0xFF
        counts[k] += 1
        changed[k] += a[i] != b[i]
    visit: np.ndarray = np.zeros(EXPONENTS, np.int64)  # the next visit place of each exponent
    slot: np.ndarray = np.zeros(EXPONENTS, np.int64)  # the next output slot of each exponent's changed words
    for k in range(1, EXPONENTS):
        visit[k] = visit[k - 1] + counts[k - 1]
        slot[k] = slot[k - 1] + changed[k - 1]
    m = slot[EXPONENTS - 1] + changed[EXPONENTS - 1]
    places = np.empty(m, np.int64)
    steps = np.empty(m, np.int32)
    for i in range(n):
        k = (a[i] >> 7) & 0xFF
        if a[i] != b[i]:
            j = slot[k]
            places[j] = visit[k]
            steps[j] = _position_of(int(b[i])) - _position_of(int(a[i]))
            slot[k] = j + 1
        visit[k] += 1
    return places, steps


def _patch_loops(words: np.ndarray, places: np.ndarray, steps: np.ndarray) -> bool:
    """Move the words at `places` (ascending visit places) by `steps`, in place; False (and `words` half patched)
    if a step leaves the range of bf16 bit patterns."""
    first = _first_places(words)
    nxt: np.ndarray = np.zeros(EXPONENTS, np.int64)  # per exponent: the next entry of `places` that falls in it
    end: np.ndarray = np.zeros(EXPONENTS, np.int64)
    j = 0
    for k in range(EXPONENTS):
        nxt[k] = j
        limit = first[k + 1] if k + 1 < EXPONENTS else words.size
        while j < places.size and places[j] < limit:
            j += 1
        end[k] = j
    state: np.ndarray = np.empty((EXPONENTS, 2), np.int64)  # per exponent: its next visit place, the next wanted
    for k in range(EXPONENTS):
        state[k, 0], state[k, 1] = first[k], places[nxt[k]] if nxt[k] < end[k] else -1
    for i in range(words.size):
        k = (words[i] >> 7) & 0xFF
        if state[k, 0] == state[k, 1]:
            p = nxt[k]
            pos = _position_of(int(words[i])) + steps[p]
            if pos < -0x8000 or pos > 0x7FFF:
                return False
            words[i] = 0x8000 | (-pos - 1) if pos < 0 else pos
            nxt[k] = p + 1
            state[k, 1] = places[p + 1] if p + 1 < end[k] else -1
        state[k, 0] += 1
    return True


if COMPILED:
    _position_of = njit(nogil=True, cache=True, inline="always")(_position_of)
    _first_places = njit(nogil=True, cache=True)(_first_places_loops)
    changes_in_visit_order = njit(nogil=True, cache=True)(_changes_loops)
    patch = njit(nogil=True, cache=True)(_patch_loops)
else:  # pragma: no cover
    changes_in_visit_order, patch = _changes_numpy, _patch_numpy


def warm_up() -> None:
    """Compile the loops now (or load them from the cache: about half a second in a fresh process), so the first
    version's delta does not pay for it: for the signatures the coder calls them with (a mapped file is a
    read-only array; the publisher's image is not)."""
    words: np.ndarray = np.zeros(4, np.uint16)
    mapped = words.copy()
    mapped.flags.writeable = False
    for target in (words, mapped):
        changes_in_visit_order(mapped, target)
    patch(words, np.zeros(0, np.int64), np.zeros(0, np.int32))
