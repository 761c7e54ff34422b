"""Flags generated from a dataclass's fields: one per field, named after it, its help the field's.

The trainer's config (:func:`~harness_trainer.launch.config_file.add_trainer_arguments`) and
:class:`~harness_trainer.rollouts.run_options.RunOptions` get their flags here, so a knob is declared once,
on its dataclass, and the command line, the config file's keys and the help follow it. A value's text is
read as the field's type: ``none`` or ``null`` for None where the field takes it, a list as words or
comma-separated (``--report-to a b``, ``--report-to a,b``), a mapping as a JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any


def add_dataclass_arguments(
    group: argparse._ActionsContainer,
    cls: type,
    *,
    defaults: Mapping[str, Any] = {},
    exclude: Iterable[str] = (),
    choices: Mapping[str, Sequence[Any]] = {},
    aliases: Mapping[str, Sequence[str]] = {},
    extra: Mapping[str, Mapping[str, Any]] = {},
    dest_prefix: str = "",
    suppress: bool = False,
) -> list[argparse.Action]:
    """A flag on ``group`` for each field of the dataclass ``cls`` (``--max-completion-length``), its help
    the field's ``help`` metadata with the default shown (its ``flag`` metadata: more argparse keywords,
    such as a stricter ``type`` or a list's ``item``). ``defaults``: the command's own defaults (else
    the field's); ``exclude``: fields the command sets itself; ``choices``: the values a field's flag
    takes; ``aliases``: more option strings of a field; ``extra``: more argparse keywords of a field's flag;
    ``dest_prefix``: put before each field's name in the namespace; ``suppress``: default to
    ``argparse.SUPPRESS`` (only a flag given lands in the namespace) but show ``defaults`` in the help."""
    skipped = set(exclude)
    hints = typing.get_type_hints(cls)
    actions = []
    for f in dataclasses.fields(cls):
        if f.name in skipped:
            continue
        default = defaults.get(f.name, field_default(f))
        help_text = f"{f.metadata.get('help', '')} (default: {_shown_default(default)})".replace("%", "%%")
        options = [f"--{f.name.replace('_', '-')}", *aliases.get(f.name, ())]
        own = dict(f.metadata.get("flag", {}))
        if "config_value" in own:  # the field reads a config file's list or mapping too
            own["type"] = ConfigValue(own["type"], own.pop("config_value"))
        kwargs: dict[str, Any] = {
            "dest": dest_prefix + f.name,
            "default": argparse.SUPPRESS if suppress else default,
            "help": help_text,
            # A ConfigValue reads the field's whole value itself: no kind of flag is derived from its type.
            **({"metavar": f.name.upper()} if isinstance(own.get("type"), ConfigValue) else {}),
            **({} if isinstance(own.get("type"), ConfigValue) else flag_kwargs(hints[f.name], f.name)),
        }
        if f.name in choices:
            kwargs["choices"] = choices[f.name]
        kwargs.update(own)  # the field's own flag keywords (a stricter type)
        actions.append(group.add_argument(*options, **{**kwargs, **extra.get(f.name, {})}))
    return actions


def flag_kwargs(hint: Any, name: str) -> dict[str, Any]:
    """argparse's keywords for a field of type ``hint``: a bool is ``--x/--no-x``, a list takes words or
    comma-separated text, a mapping a JSON object, anything else one value of its type."""
    if hint is bool or hint == bool | None:
        return {"action": argparse.BooleanOptionalAction}
    arms = _arms(hint)
    listed = [arm for arm in arms if typing.get_origin(arm) is list]
    if listed:
        (item,) = typing.get_args(listed[0]) or (str,)
        return {"nargs": "+", "action": CommaList, "type": None, "metavar": name.upper(), "item": item}
    if any(typing.get_origin(arm) is dict for arm in arms) and str not in arms:
        return {"type": json_object, "metavar": "JSON"}
    return {"type": scalar(hint), "metavar": name.upper()}


def field_default(f: dataclasses.Field[Any]) -> Any:
    """A dataclass field's default (its factory's value where it has one)."""
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def _shown_default(default: Any) -> Any:
    return json.dumps(default) if isinstance(default, dict) else default


class ConfigValue:
    """A field's flag type that reads its flag's text (``text``) and, for a config file's key, a list or
    mapping too (``value``): a field whose value takes several shapes (``--harness a=2,b=1`` on the command
    line, ``harness: {a: 2, b: 1}`` in a file)."""

    def __init__(self, text: Callable[[str], Any], value: Callable[[Any], Any]) -> None:
        self.text, self.value = text, value
        self.__name__ = getattr(text, "__name__", "value")  # argparse names the type in its errors

    def __call__(self, text: str) -> Any:
        try:
            return self.text(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None


class CommaList(argparse.Action):
    """``--report-to a b`` and ``--report-to a,b`` both give ``["a", "b"]``; each item is read as ``item``
    (``--task-indices 0,3`` gives ``[0, 3]``). :meth:`items` reads a config file's value the same way."""

    def __init__(self, *args: Any, item: Callable[[str], Any] = str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.item = item

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Any = None) -> None:
        try:
            setattr(namespace, self.dest, self.items(values))
        except ValueError as exc:
            raise argparse.ArgumentError(self, str(exc)) from None

    def items(self, values: Iterable[Any]) -> list[Any]:
        """Words (or one comma-separated text each) as the field's items; raises ValueError."""
        texts = [part.strip() for value in values for part in str(value).split(",") if part.strip()]
        if not texts:
            raise ValueError(f"expected one or more values, got {list(values)!r}")
        try:
            return [self.item(text) for text in texts]
        except ValueError as exc:
            raise ValueError(f"{list(values)!r}: {exc}") from None


def json_object(text: str) -> dict[str, Any]:
    """A mapping flag's text: a JSON object."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r} ({exc.msg})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def scalar(hint: Any) -> Callable[[str], Any]:
    """A flag's text as the field's type: ``none`` or ``null`` for None where the field takes it."""
    arms = _arms(hint)

    def convert(text: str) -> Any:
        if type(None) in arms and text.lower() in ("none", "null"):
            return None
        for arm in arms:
            try:
                if arm is int:
                    return int(text)
                if arm is float:
                    return float(text)
            except ValueError:
                continue
            if arm is str or typing.get_origin(arm) is dict:  # a dict field takes JSON text
                return text
        raise argparse.ArgumentTypeError(f"expected {describe(hint)}, got {text!r}")

    return convert


def describe(hint: Any) -> str:
    """A type in words, for an error: ``int or null``, ``a list of str``."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(describe(arm) for arm in typing.get_args(hint))
    if hint is type(None):
        return "null"
    if typing.get_origin(hint) is list:
        return f"a list of {describe(typing.get_args(hint)[0])}"
    if typing.get_origin(hint) is dict:
        return "a mapping"
    return getattr(hint, "__name__", str(hint))


def _arms(hint: Any) -> tuple[Any, ...]:
    return typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
