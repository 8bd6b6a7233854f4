"""Command-line options derived from a command's pydantic config: one option per field, named after it, with the
field's description as help and its default shown.

    @app.command()
    @options_from(LearnerConfig, names={"out_dir": "--out"}, short={"staleness": "-S"})
    def learner(given: dict[str, Any], config: Path | None = ConfigOpt) -> None:
        cfg = load_config(LearnerConfig, config, given, "learner")

The command's own parameters (render options such as `--json`, or `--config`) come first; `given` holds the
config fields set on the command line, and only those, so that `load_config` can rank flags above the TOML file
and the environment (defaults < TOML < ECHO2_* env < flags); the config's own validation then reports a bad
value in one line. Fields holding a table (dict) come from TOML only. A config class may
group its fields under headings in `--help` with a `HELP_PANELS` class variable: heading -> field names, spaced.
"""

from __future__ import annotations

import functools
import inspect
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, TypeVar

import typer
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

F = TypeVar("F", bound=Callable[..., Any])
SIMPLE = (bool, int, float, str, Path)
CONTEXT = "echo2_context"  # typer hands the command its context here: which options came from the command line


def options_from(
    cls: type[BaseModel], *, names: dict[str, str] | None = None, short: dict[str, str] | None = None
) -> Callable[[F], F]:
    """Decorate a command `fn(given, **own_options)` so that every field of `cls` is also an option of it."""
    names, short = names or {}, short or {}
    panels = {field: panel for panel, fields in getattr(cls, "HELP_PANELS", {}).items() for field in fields.split()}

    def decorate(fn: F) -> F:
        hints = typing.get_type_hints(fn)
        own = [
            p.replace(annotation=hints.get(p.name, p.annotation), kind=inspect.Parameter.KEYWORD_ONLY)
            for p in inspect.signature(fn).parameters.values()
            if p.name != "given"
        ]
        fields = {name: field for name, field in cls.model_fields.items() if _option_type(field.annotation) is not None}
        generated = [
            _parameter(name, field, names.get(name), short.get(name), panels.get(name))
            for name, field in fields.items()
        ]

        @functools.wraps(fn)
        def command(**kwargs: Any) -> Any:
            ctx: typer.Context = kwargs.pop(CONTEXT)
            values = {name: kwargs.pop(name, None) for name in fields}
            given = {
                n: v for n, v in values.items() if getattr(ctx.get_parameter_source(n), "name", "") == "COMMANDLINE"
            }
            return fn(given, **kwargs)

        context = inspect.Parameter(CONTEXT, inspect.Parameter.KEYWORD_ONLY, annotation=typer.Context)
        params = [context, *own, *generated]
        command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in params}
        return typing.cast(F, command)

    return decorate


def _option_type(annotation: Any) -> Any:
    """What typer parses a field as: its type without `None`; a Literal's values as str; list[str] stays;
    None for a type the command line cannot carry (a table)."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return _option_type(args[0]) if len(args) == 1 else None
    if typing.get_origin(annotation) is Literal:
        return str
    if typing.get_origin(annotation) is list and args == [str]:
        return list[str]
    return annotation if annotation in SIMPLE else None


def _parameter(
    name: str, field: FieldInfo, flag: str | None, short: str | None, panel: str | None
) -> inspect.Parameter:
    decls = [flag or "--" + name.replace("_", "-"), *([short] if short else [])]
    default, shown = _default(field)
    option = typer.Option(default, *decls, help=_help(field), show_default=shown, rich_help_panel=panel)
    return inspect.Parameter(
        name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=_option_type(field.annotation) | None
    )


def _help(field: FieldInfo) -> str:
    text = field.description or ""
    if field.is_required():
        text += " (required)"
    if typing.get_origin(field.annotation) is Literal:
        text += f" ({' | '.join(map(str, typing.get_args(field.annotation)))})"
    return text.replace("[", "\\[")  # rich markup: a literal bracket


def _default(field: FieldInfo) -> tuple[Any, str | bool]:
    """(the option's default, what --help shows of it): the field's own default, or a description of it where that
    is None, computed at start-up (a name from host and pid) or given by the field (`shown_default`)."""
    extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
    if "shown_default" in extra:
        return None, str(extra["shown_default"])
    if field.is_required() or field.default_factory is not None and field.default_factory is not list:
        return None, False
    default = field.get_default(call_default_factory=True)
    return (None, "none") if default is None or default is PydanticUndefined else (default, True)
