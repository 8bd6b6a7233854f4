"""Untrusted text (worker names, a learner's details) prints as itself: never rich markup, never terminal control,
never longer than its bound. Each check renders with rich, as the commands do."""

from __future__ import annotations

import io
import sys
import unicodedata

import pytest
from rich.console import Console

from echo2cli import cli
from echo2cli.demo import summary_table
from echo2cli.errors import ProtocolError
from echo2cli.textsafe import NAME_LEN, shown

HOSTILE = {  # the name a worker gives -> what a person must see
    "x[/]": "x[/]",
    "[bold]loud[/bold]": "[bold]loud[/bold]",
    "[link=http://evil]click": "[link=http://evil]click",
    "\x1b[31mred\x1b[0m": "\\x1b[31mred\\x1b[0m",
    "\x1b]0;title\x07": "\\x1b]0;title\\x07",
    "two\nlines\r\ttab": "two\\nlines\\r\\ttab",
    "\u202eevil\u200b": "\\u202eevil\\u200b",  # a bidi override and a zero-width space
    "del\x7f c1\x9b": "del\\x7f c1\\x9b",
}


def printed(*renderables: object, width: int = 200) -> str:
    out = io.StringIO()
    Console(file=out, width=width).print(*renderables)
    return out.getvalue()


def no_control(text: str) -> bool:
    return all(unicodedata.category(c)[0] != "C" for c in text.replace("\n", ""))


@pytest.mark.parametrize(("name", "seen"), HOSTILE.items())
def test_markup_and_control_characters_print_as_literal_text(name, seen):
    out = printed(shown(name))
    assert out == seen + "\n" and no_control(out)
    assert printed(f"[bold]worker {shown(name)}[/] joined") == f"worker {seen} joined\n"  # inside our own markup


def test_a_trailing_backslash_does_not_escape_the_markup_after_it():
    assert printed(f"[yellow]retrying: {shown('C:' + chr(92))}[/] now") == "retrying: C:" + chr(92) + " now\n"


def test_a_long_name_is_cut_to_its_bound_with_an_ellipsis_and_no_escape_is_split():
    assert printed(shown("n" * 128)) == "n" * 128 + "\n"  # the longest name a worker may give shows whole
    assert printed(shown("n" * 200)) == "n" * (NAME_LEN - 1) + "…\n"
    assert shown("a" * (NAME_LEN - 2) + "\x1b[2J") == "a" * (NAME_LEN - 2) + "…"  # not half of \x1b
    assert shown("short") == "short" and len(shown("\n" * 1000, 10)) <= 10


def test_an_activation_line_with_hostile_names_is_one_literal_line(monkeypatch):
    out = io.StringIO()
    monkeypatch.setattr(cli, "console", Console(file=out, width=200))
    names = list(HOSTILE)
    cli._print_decision(
        {"active": names[:5], "standby": names[5:], "decision": "all active", "reason": f"joined: {', '.join(names)}"}
    )
    text = out.getvalue()
    assert text.count("\n") == 1 and no_control(text)
    assert all(seen in text for seen in HOSTILE.values())


def test_the_demo_summary_shows_hostile_names_as_text():
    summary = {
        "steps": 3,
        "seed": 0,
        "wall_s": 10.0,
        "reward_start": 0.1,
        "reward_end": 0.5,
        "t_train_s_median": 1.0,
        "t_bcast_s_median": 0.5,
        "bubble_ratio": 0.1,
        "upload_ratio_median": 1.0,
        "staleness_max": 1,
        "activation": "x[/], \x1b[31mred active, none on standby",
        "metrics": "runs/demo/metrics.jsonl",
    }
    text = printed(summary_table(summary))
    assert "x[/], \\x1b[31mred active" in text and no_control(text)


def test_an_error_quoting_a_learners_detail_is_one_literal_line(monkeypatch, capsys):
    class Refusing:
        def __init__(self, *args, **kwargs) -> None:
            pass

        def status(self):
            raise ProtocolError("learner answered 400 to GET /v1/status: x[/]\n\x1b[2Jforged line")

    monkeypatch.setattr("echo2cli.worker.client.LearnerClient", Refusing)
    monkeypatch.setattr(sys, "argv", ["echo2", "status", "http://127.0.0.1:9"])
    with pytest.raises(SystemExit) as exit_:
        cli.main()
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and no_control(err)
    assert "echo2: error: learner answered 400 to GET /v1/status: x[/]\\n\\x1b[2Jforged line" in err
