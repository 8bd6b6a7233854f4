"""Untrusted text made safe to print with rich: worker names, a learner's answers, error details.

Workers and learners are untrusted (docs/DESIGN.md, trust model), and so is what they name themselves or say. Printed
as it came, such text is rich markup (a worker named `x[/]` makes rich raise MarkupError; `[bold]...` restyles the
line) and terminal control (ESC sequences recolour, retitle or clear the terminal; a newline forges a line; a bidi
override shows the text in another order). `shown(text)` is the one way to print it:

1. every control or format character (Unicode categories Cc, Cf, Cs, Zl, Zp: C0, DEL, C1, bidi overrides,
   zero-width characters, line and paragraph separators, lone surrogates) becomes its visible Python escape
   (`\\x1b`, `\\n`, `\\u202e`);
2. the result is cut to `max_len` characters, an ellipsis marking the cut;
3. then markup-escaped (`rich.markup.escape`), so it prints as the literal text inside markup of our own (a
   trailing backslash is doubled so that it cannot escape the tag after it; printed alone, it shows doubled).

Rich's `:emoji:` codes are left as they are: they turn into an emoji at most, never into markup or control.
"""

from __future__ import annotations

import unicodedata

from rich.markup import escape

NAME_LEN = 128  # a worker's name (protocol: at most 128 characters), whole
DETAIL_LEN = 1024  # a learner's detail or reason (protocol.MAX_TEXT), or an error message quoting one
HIDDEN = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})


def visible(ch: str) -> str:
    """One character as it prints: itself, or its Python escape if it controls or formats the terminal's text."""
    if unicodedata.category(ch) in HIDDEN:
        return ch.encode("unicode_escape").decode("ascii")
    return ch


def shown(text: object, max_len: int = NAME_LEN) -> str:
    """`str(text)` safe to print with rich (see the module docstring): no control character, at most `max_len`
    characters before markup-escaping, and no markup."""
    pieces, n = [], 0
    for ch in str(text)[: max_len + 1]:  # each character shows as one or more: the rest cannot fit
        piece = visible(ch)
        pieces.append(piece)
        n += len(piece)
        if n > max_len:
            while n > max_len - 1:  # room for the ellipsis
                n -= len(pieces.pop())
            pieces.append("…")
            break
    return escape("".join(pieces))
