"""``--config run.yaml``: one YAML file for a command's options and the trainer's config, under its flags.

A config file has top-level sections (``serve``'s has only its own, ``serve``). ``trainer`` holds
:class:`~harness_trainer.trainer.config.async_grpo.AsyncGRPOConfig` (every field; the loss's knobs under
``trainer.loss``, or flat under TRL's names); the command's own section holds its options by their flag's
name with underscores (``run`` for ``harness-trainer train``, ``dev`` for
``harness-trainer dev``, ``job`` for ``harness-trainer jobs submit``, whose file also carries the ``run``
and ``trainer`` sections of the run it submits).

Every value is layered the same way: the default (the dataclass field's, or the command's own
default for that knob) < the config file < a command-line flag actually given. Flags tell "given" from
"default" by defaulting to ``argparse.SUPPRESS``: :func:`configurable` moves a parser's defaults aside,
:func:`apply_config` puts back, for each option, the flag, else the file's value, else the default.

A file with unknown keys or values of the wrong type raises one :class:`ConfigFileError` listing every
problem, each with the file and the dotted key.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from harness_trainer.harnesses import HARNESSES
from harness_trainer.launch.dataclass_flags import (
    CommaList,
    ConfigValue,
    add_dataclass_arguments,
    describe,
    json_object,
)
from harness_trainer.rollouts.harness_mix import harness_mix, parse_harness_text
from harness_trainer.rollouts.run_options import CHOICES as RUN_CHOICES
from harness_trainer.rollouts.run_options import DEFAULT_RUN, RunOptions
from harness_trainer.sandboxes import describe_backends
from harness_trainer.trainer.config.async_grpo import AsyncGRPOConfig
from harness_trainer.trainer.config.loss import LOSS_FIELDS, LossConfig
from harness_trainer.trainer.config.trl_fields import TRL_ONLY

TRAINER = "trainer"
"""The section of the trainer's config, in every command's file."""
RESOLVED_FILE = "run_config.json"
"""Written in the run's output directory at start: every section, resolved (see :func:`write_resolved`)."""
_TRAINER_DEST = "trainer."
_LAYERS = "config_layers"


class ConfigFileError(ValueError):
    """Every problem of one config file; each of ``problems`` names the file and the dotted key."""

    def __init__(self, path: Path, problems: Sequence[str]) -> None:
        self.path = path
        self.problems = [f"{path}: {problem}" for problem in problems]
        super().__init__("; ".join(self.problems))


# -- the trainer section ------------------------------------------------------------------------------


def trainer_problems(section: Any, key: str = TRAINER) -> list[str]:
    """The unknown keys and wrong types of a ``trainer`` section, each as ``key.name: problem``."""
    if not isinstance(section, dict):
        return [f"{key}: expected a mapping of AsyncGRPOConfig fields, got {_shown(section)}"]
    hints = _hints(AsyncGRPOConfig)
    loss_hints = _hints(LossConfig)
    problems = []
    for name, value in section.items():
        if name == "loss":
            problems += _fields_problems(value, loss_hints, f"{key}.loss", "LossConfig")
        elif name in hints:
            problems += _value_problems(value, hints[name], f"{key}.{name}")
        elif name in LOSS_FIELDS:  # TRL's flat names of the loss's knobs
            problems += _value_problems(value, loss_hints[name], f"{key}.{name}")
        elif name not in TRL_ONLY:  # TRL's other names: AsyncGRPOConfig checks their values
            problems.append(f"{key}.{name}: unknown key (not an AsyncGRPOConfig field, nor TRL's)")
    return problems


def _fields_problems(section: Any, hints: Mapping[str, Any], key: str, what: str) -> list[str]:
    if not isinstance(section, dict):
        return [f"{key}: expected a mapping of {what} fields, got {_shown(section)}"]
    problems = []
    for name, value in section.items():
        if name in hints:
            problems += _value_problems(value, hints[name], f"{key}.{name}")
        else:
            problems.append(f"{key}.{name}: unknown key (not a {what} field)")
    return problems


def _value_problems(value: Any, hint: Any, key: str) -> list[str]:
    if _matches(value, hint):
        return []
    return [f"{key}: expected {describe(hint)}, got {_shown(value)}"]


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _matches(value: Any, hint: Any) -> bool:
    """Whether a YAML value has the field's type (an int is a float; a bool is neither)."""
    origin = typing.get_origin(hint)
    if hint is Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, arm) for arm in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if origin is list:
        (item,) = typing.get_args(hint)
        return isinstance(value, list) and all(_matches(v, item) for v in value)
    if origin is dict or dataclasses.is_dataclass(hint):
        return isinstance(value, dict)
    return isinstance(value, hint)


def _shown(value: Any) -> str:
    return f"{type(value).__name__} {value!r}"


def trainer_values(defaults: Mapping[str, Any], *layers: Mapping[str, Any]) -> dict[str, Any]:
    """``AsyncGRPOConfig``'s keyword arguments: ``defaults``, then each layer over it (a file's section, the
    flags given); the loss's knobs, flat or under ``loss``, are merged key by key into ``loss``."""
    values: dict[str, Any] = {}
    loss: dict[str, Any] = {}
    for layer in (defaults, *layers):
        for name, value in layer.items():
            if name == "loss":
                loss.update(value)
            elif name in LOSS_FIELDS:
                loss[name] = value
            else:
                values[name] = value
    return {**values, "loss": loss} if loss else values


# -- trainer flags derived from the dataclass fields --------------------------------------------------


def add_trainer_arguments(
    parser: argparse.ArgumentParser,
    *,
    defaults: Mapping[str, Any],
    exclude: Iterable[str] = (),
    aliases: Mapping[str, Sequence[str]] = {},
    extra: Mapping[str, Mapping[str, Any]] = {},
) -> None:
    """A flag for each ``AsyncGRPOConfig`` field and each loss knob (flat), named after it
    (``--max-completion-length``), its help the field's; it defaults to ``SUPPRESS`` so only a flag given
    lands in the namespace (as ``trainer.NAME``). ``defaults``: the command's own defaults, shown in the
    help; ``exclude``: fields the command sets itself; ``aliases``: more option strings of a field;
    ``extra``: argparse keywords of a field's flag (``nargs``, ``const``)."""
    group = parser.add_argument_group(
        "trainer", "AsyncGRPOConfig's fields (the trainer section of --config); the loss's knobs flat"
    )
    shared = {"defaults": defaults, "aliases": aliases, "extra": extra, "dest_prefix": _TRAINER_DEST}
    add_dataclass_arguments(group, AsyncGRPOConfig, exclude=[*exclude, "loss"], suppress=True, **shared)
    add_dataclass_arguments(group, LossConfig, exclude=exclude, suppress=True, **shared)


def given_trainer_flags(namespace: argparse.Namespace) -> dict[str, Any]:
    """The trainer flags given on the command line, by field name."""
    return {
        dest[len(_TRAINER_DEST) :]: value
        for dest, value in vars(namespace).items()
        if dest.startswith(_TRAINER_DEST)
    }


# -- the run's options (RunOptions), in a command's own section ----------------------------------------


def add_run_arguments(
    parser: argparse.ArgumentParser,
    *,
    defaults: Mapping[str, Any] = {},
    exclude: Iterable[str] = (),
    choices: Mapping[str, Sequence[Any]] = {},
) -> None:
    """A flag for each :class:`~harness_trainer.rollouts.run_options.RunOptions` field the command takes
    (``exclude``: those it does not), with the command's own ``defaults`` and narrowed ``choices``; they are
    the command's own options, so its config section holds them by field name. :func:`run_options_from`
    reads them back."""
    group = parser.add_argument_group("tasks and agents", "RunOptions: the rollouts' knobs")
    sandbox, harness = (defaults.get(name, getattr(DEFAULT_RUN, name)) for name in ("sandbox", "harness"))
    narrowed_harnesses = choices.get("harness")  # a command's own subset; else preflight checks the names
    names = tuple(narrowed_harnesses or HARNESSES)

    def known_harnesses(value: Any) -> Any:
        """A harness value (one name, a list, weights) whose every name the command takes."""
        mix = harness_mix(value)
        unknown = [name for name in mix.names if narrowed_harnesses and name not in narrowed_harnesses]
        if unknown:
            raise ValueError(f"unknown harness {', '.join(map(repr, unknown))} (known: {', '.join(names)})")
        return mix.value()

    # The registries' own words: the rollout client, where RunOptions lives, imports neither registry.
    described = {
        "sandbox": {"help": f"where agents run: {describe_backends()} (default: {sandbox})"},
        "harness": {
            "help": f"the agent (black-box mode): {', '.join(names)}; several, each GRPO group using one: "
            f"a,b (round-robin over groups) or a=2,b=1 (weighted) (default: {harness})",
            "type": ConfigValue(lambda text: known_harnesses(parse_harness_text(text)), known_harnesses),
        },
    }
    narrowed = {name: values for name, values in {**RUN_CHOICES, **choices}.items() if name != "harness"}
    add_dataclass_arguments(
        group, RunOptions, defaults=defaults, exclude=exclude, choices=narrowed, extra=described
    )


def run_options_from(namespace: argparse.Namespace, **fixed: Any) -> RunOptions:
    """The run's options from a namespace :func:`apply_config` layered (``fixed``: fields the command does
    not take a flag for).

    Raises:
        ValueError: what :class:`RunOptions` refuses.
    """
    names = [f.name for f in dataclasses.fields(RunOptions)]
    given = {name: getattr(namespace, name) for name in names if hasattr(namespace, name)}
    return RunOptions(**{**given, **fixed})


# -- a command's own options --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Layers:
    """What :func:`configurable` moved aside: the section, the options' defaults, and the other sections
    its files may hold (with the parser that checks each; None: the trainer section)."""

    section: str
    defaults: dict[str, Any]
    actions: dict[str, argparse.Action]
    required: tuple[str, ...]
    others: dict[str, argparse.ArgumentParser | None]


def configurable(
    parser: argparse.ArgumentParser,
    section: str,
    others: Mapping[str, argparse.ArgumentParser] = {},
    *,
    trainer: bool = True,
) -> None:
    """Add ``--config`` to ``parser`` and make its options (not the trainer flags, nor positionals) default to
    ``SUPPRESS``; :func:`apply_config` layers them after parsing. A file holds the ``section`` of these
    options, ``trainer`` (unless ``trainer`` is false: a command that trains nothing), and ``others``
    (checked against their parsers' options)."""
    sections = f"the {section} and trainer sections" if trainer else f"the {section} section"
    parser.add_argument(
        "--config", type=Path, default=None, metavar="FILE",
        help=f"a YAML config file: {sections}; flags given win over it",
    )  # fmt: skip
    actions = {
        a.dest: a
        for a in parser._actions  # argparse has no public list of a parser's actions
        if a.option_strings and a.dest not in ("help", "config") and not a.dest.startswith(_TRAINER_DEST)
    }
    defaults = {dest: _converted(a, a.default) for dest, a in actions.items()}
    required = tuple(dest for dest, a in actions.items() if a.required)
    for a in actions.values():
        a.default, a.required = argparse.SUPPRESS, False
    known = {TRAINER: None, **others} if trainer else dict(others)
    parser.set_defaults(**{_LAYERS: _Layers(section, defaults, actions, required, known)})


def apply_config(namespace: argparse.Namespace) -> argparse.Namespace:
    """Fill in each option of the command :func:`configurable` prepared: the flag given, else the config
    file's value, else the default; the file's other sections land in ``namespace.config_sections``.

    Raises:
        ConfigFileError: the file is unreadable, or has unknown keys or values of the wrong type (all
            listed), or a required option is in neither the flags nor the file.
    """
    layers: _Layers = getattr(namespace, _LAYERS)
    path: Path | None = namespace.config
    sections = read_config(path, layers) if path is not None else {}
    from_file = sections.pop(layers.section, {})
    for dest, default in layers.defaults.items():
        if not hasattr(namespace, dest):
            setattr(namespace, dest, from_file.get(dest, default))
    missing = [dest for dest in layers.required if getattr(namespace, dest) is None]
    if missing:
        flag, key = layers.actions[missing[0]].option_strings[0], f"{layers.section}.{missing[0]}"
        if path is None:
            raise ValueError(f"{flag} is required (or {key} in a --config file)")
        raise ConfigFileError(path, [f"{key}: required (or {flag})"])
    namespace.config_sections = sections
    return namespace


def read_config(path: Path, layers: _Layers) -> dict[str, dict[str, Any]]:
    """The file's sections, every value checked, the command's own section's values converted as
    argparse converts its flags' text.

    Raises:
        ConfigFileError: every problem, each with the file and the dotted key.
    """
    import yaml

    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigFileError(path, [f"cannot read it as YAML: {' '.join(str(exc).split())}"]) from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigFileError(path, [f"expected a mapping of sections, got {_shown(data)}"])
    known = {layers.section: None, **layers.others}
    problems: list[str] = []
    sections: dict[str, dict[str, Any]] = {}
    for name, section in data.items():
        if name not in known:
            problems.append(f"{name}: unknown section (this command's: {', '.join(sorted(known))})")
        elif name == TRAINER:
            problems += trainer_problems(section)
        elif name == layers.section:
            values, found = _options(section, layers.actions, name)
            problems += found
            section = values
        else:
            other = known[name]
            assert other is not None
            actions = {a.dest: a for a in other._actions if a.dest != "help"}
            problems += _options(section, actions, name)[1]
        sections[name] = section
    if problems:
        raise ConfigFileError(path, problems)
    return sections


def _options(
    section: Any, actions: Mapping[str, argparse.Action], key: str
) -> tuple[dict[str, Any], list[str]]:
    """A command section's values, converted as their flags' text would be, and its problems."""
    if not isinstance(section, dict):
        return {}, [f"{key}: expected a mapping of options, got {_shown(section)}"]
    values, problems = {}, []
    for name, value in section.items():
        action = actions.get(name)
        if action is None or name.startswith(_TRAINER_DEST):
            problems.append(f"{key}.{name}: unknown key (options: {', '.join(sorted(actions))})")
            continue
        try:
            values[name] = _option_value(action, value)
        except (TypeError, ValueError, argparse.ArgumentTypeError) as exc:
            problems.append(f"{key}.{name}: {exc}")
    return values, problems


def _option_value(action: argparse.Action, value: Any) -> Any:
    """``value`` for ``action`` as its flag would give it; raises TypeError or ValueError."""
    if action.nargs == 0:  # store_true and its kin: the key is the destination, the value its value
        if not isinstance(value, bool):
            raise TypeError(f"expected true or false, got {_shown(value)}")
        return value
    if isinstance(action, CommaList):
        return action.items(value if isinstance(value, list) else [value])
    if isinstance(action.type, ConfigValue):
        return action.type.value(value) if isinstance(value, dict | list) else action.type(str(value))
    if action.type is json_object and isinstance(value, dict):
        return value
    if isinstance(action, argparse._AppendAction) or action.nargs in ("+", "*"):
        # One value where a list goes is that list of one, as one word after the flag would be.
        items = value if isinstance(value, list) else [value]
        return [_one_value(action, item) for item in items]
    if value is None:
        return None
    return _one_value(action, value)


def _one_value(action: argparse.Action, value: Any) -> Any:
    if isinstance(value, dict | list) or (isinstance(value, bool) and action.type is not bool):
        raise TypeError(f"expected a single value, got {_shown(value)}")
    converted = action.type(str(value)) if action.type is not None else str(value)
    if action.choices is not None and converted not in action.choices:
        raise ValueError(f"{converted!r} is not one of {list(action.choices)}")
    return converted


def _converted(action: argparse.Action, default: Any) -> Any:
    """A default as argparse gives it: text converted by the flag's type."""
    if isinstance(default, str) and action.type is not None:
        return action.type(default)
    return default


# -- the resolved config, beside the run --------------------------------------------------------------


def write_resolved(output_dir: str | os.PathLike[str], sections: Mapping[str, Any]) -> Path:
    """Write ``OUTPUT_DIR/run_config.json``: each section as the run uses it (a config file in the same
    shape, every value resolved; ``trainer`` as ``AsyncGRPOConfig.to_dict()``, its secret masked).
    Written atomically, at the start of the run."""
    folder = Path(output_dir)
    folder.mkdir(parents=True, exist_ok=True)
    staging = folder / f".{RESOLVED_FILE}.{os.getpid()}.tmp"
    staging.write_text(json.dumps(sections, indent=2, default=str) + "\n")
    os.replace(staging, folder / RESOLVED_FILE)
    return folder / RESOLVED_FILE
