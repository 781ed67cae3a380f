"""One config mechanism: a schema of typed fields, checked once, flags derived.

A run, a study or a benchmark contender is a plain dict of named values.
Its `Schema` lists the fields (name, kind, default, accepted values, help)
and the checks that tie fields together. `Schema.resolve` fills the
defaults and checks every value; `Schema.define_flags` derives absl flags
from the same fields, and `Schema.flag_overrides` turns the flags a user set
into config values with the same checks. Every problem is one `ConfigError`
line naming the key and echoing the value, in the Keras style:

>>> schema = Schema("demo", [
...     Field("steps", "int", 4, "micro-batches per update", minimum=1),
...     Field("rule", "str", None, "scaling rule", choices=("invariant", "sqrt")),
... ])
>>> schema.resolve({"steps": 8})
{'steps': 8, 'rule': None}
>>> schema.resolve({"steps": 0})
Traceback (most recent call last):
...
keras_accum.experiments.config.ConfigError: `steps` must be an integer >= 1. Received: steps=0
>>> schema.resolve({"stpes": 8})
Traceback (most recent call last):
...
keras_accum.experiments.config.ConfigError: Unknown config key 'stpes'. Valid keys: rule, steps

A field whose default is None also accepts None (a flag spells it "none").
A config file is a Python file whose `get_config(*args)` returns the dict
(`load_file`); a run folder's config.json is read with `load_json`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from keras_accum import validation

KINDS = ("int", "float", "bool", "str", "dict", "path", "list")


class ConfigError(ValueError):
    """A bad config value, flag or config file: one line, no traceback."""


@dataclasses.dataclass(frozen=True)
class Field:
    """One config key: its kind, default, accepted values and help.

    `kind` is one of KINDS ("path": a string naming a file or folder).
    Numbers may be bounded by `minimum` / `maximum` (closed unless
    `open_minimum` / `open_maximum`); `choices` lists the accepted values.
    A default of None makes None an accepted value too. A "list" holds at
    least `minimum` (default 1) items, each checked by the Field `item`
    (its name is not used); a flag spells it comma-separated:

    >>> ks = Field("ks", "list", [1, 2], "kappas to compare",
    ...            item=Field("", "int", 1, "", minimum=1))
    >>> ks.parse("1,4,8")
    [1, 4, 8]
    >>> ks.check([1, 0])
    Traceback (most recent call last):
    ...
    keras_accum.experiments.config.ConfigError: `ks[1]` must be an integer >= 1. Received: ks[1]=0
    """

    name: str
    kind: str
    default: Any
    help: str
    choices: tuple | None = None
    minimum: float | None = None
    maximum: float | None = None
    open_minimum: bool = False
    open_maximum: bool = False
    flag: bool = True  # Exposed as a script flag.
    item: Field | None = None  # kind="list": the check of each item.

    def __post_init__(self):
        validation.check_choice("kind", self.kind, KINDS)

    def check(self, value: Any) -> Any:
        """`value` if acceptable (ints as floats for "float"), else ConfigError."""
        if value is None and self.default is None:
            return None
        try:
            return self._check(value)
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def _check(self, value):
        name = self.name
        if self.choices is not None:
            return validation.check_choice(name, value, self.choices)
        if self.kind == "bool":
            return validation.check_bool(name, value)
        if self.kind == "int":
            low = -(2**63) if self.minimum is None else int(self.minimum)
            value = validation.check_int(name, value, minimum=low)
            if self.maximum is not None and value > self.maximum:
                raise ValueError(
                    f"`{name}` must be an integer <= {self.maximum}. Received: {name}={value!r}"
                )
            return value
        if self.kind == "float":
            if isinstance(value, str):  # float("1e-3") would pass: refuse text.
                try:
                    validation.check_float(name, math.nan, **self._bounds())
                except ValueError as e:
                    message = str(e).rsplit(" Received:", 1)[0]
                    raise ValueError(f"{message} Received: {name}={value!r}") from None
            return validation.check_float(name, value, **self._bounds())
        if self.kind == "list":
            return self._check_list(value)
        if self.kind == "dict":
            if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
                raise ValueError(
                    f"`{name}` must be a dict with string keys. Received: {name}={value!r}"
                )
            return dict(value)
        if not isinstance(value, str) or not value:
            what = "a path" if self.kind == "path" else "a string"
            raise ValueError(f"`{name}` must be {what}. Received: {name}={value!r}")
        return value

    def _check_list(self, value):
        least = 1 if self.minimum is None else int(self.minimum)
        listlike = isinstance(value, Iterable) and not isinstance(value, (str, bytes, Mapping))
        items = list(value) if listlike else None
        if items is None or len(items) < least:
            raise ValueError(
                f"`{self.name}` must be a list of at least {least} item(s). "
                f"Received: {self.name}={value!r}"
            )
        if self.item is None:
            return items
        return [
            dataclasses.replace(self.item, name=f"{self.name}[{i}]").check(x)
            for i, x in enumerate(items)
        ]

    def _bounds(self):
        return {
            "minimum": self.minimum,
            "maximum": self.maximum,
            "open_minimum": self.open_minimum,
            "open_maximum": self.open_maximum,
        }

    def parse(self, text: str) -> Any:
        """The value a flag's `text` stands for, checked."""
        if text.lower() == "none" and self.default is None:
            return None
        value: Any = text
        if self.kind == "int":
            try:
                value = int(text)
            except ValueError:
                pass  # check() names the culprit.
        elif self.kind == "float":
            try:
                value = float(text)
            except ValueError:
                pass
        elif self.kind == "list":
            item = self.item or Field(self.name, "str", "", "")
            parts = [t.strip() for t in text.split(",") if t.strip()]
            return self.check([dataclasses.replace(item, name=self.name).parse(t) for t in parts])
        elif self.kind == "dict":
            try:
                value = json.loads(text)
            except json.JSONDecodeError:
                raise ConfigError(
                    f"`{self.name}` must be a JSON object, e.g. '{{\"channels\": 32}}'. "
                    f"Received: --{self.name}={text!r}"
                ) from None
        return self.check(value)

    def describe(self) -> str:
        """The accepted values in words, for --help."""
        if self.choices is not None:
            accepted = "one of " + ", ".join(map(_flag_text, self.choices))
        elif self.kind in ("int", "float") and (self.minimum, self.maximum) != (None, None):
            low = "(" if self.open_minimum else "["
            high = ")" if self.open_maximum else "]"
            lo = "-inf" if self.minimum is None else self.minimum
            hi = "inf" if self.maximum is None else self.maximum
            accepted = f"{self.kind} in {low}{lo}, {hi}{high}"
        else:
            accepted = self.kind
        if self.default is None and self.choices is None:
            accepted += " or none"
        return f"{self.help} ({accepted}; default {_flag_text(self.default)})"


# The item of a list of positive floats (learning rates).
POSITIVE = Field("", "float", 1e-3, "", minimum=0.0, open_minimum=True)


def fraction(name: str, default: float, help: str) -> Field:
    """A float in [0, 1) (a beta, an EMA decay, a held-out fraction)."""
    return Field(name, "float", default, help, minimum=0.0, maximum=1.0, open_maximum=True)


def names(name: str, default: Iterable[str], help: str, choices: tuple | None = None) -> Field:
    """A list of at least one string, each among `choices` when given."""
    return Field(name, "list", list(default), help, item=Field("", "str", "", "", choices=choices))


def _flag_text(value):
    if value is None:
        return "none"
    return json.dumps(value) if isinstance(value, dict) else str(value)


class Schema:
    """The fields of one kind of config and the checks that span fields.

    `checks` are callables taking the resolved dict and raising
    ConfigError (or ValueError) on a bad combination.
    """

    def __init__(
        self,
        name: str,
        fields: Iterable[Field],
        checks: Iterable[Callable[[dict], None]] = (),
    ):
        self.name = name
        self.fields = {f.name: f for f in fields}
        self.checks = tuple(checks)

    def defaults(self) -> dict:
        return {name: f.default for name, f in self.fields.items()}

    def resolve(self, config: Mapping | None) -> dict:
        """Defaults updated with `config`, every value and check passed."""
        if config is None:
            config = {}
        if not isinstance(config, Mapping):
            raise ConfigError(f"A {self.name} config must be a dict. Received: {config!r}")
        unknown = sorted(set(config) - set(self.fields), key=str)
        if unknown:
            plural = "s" if len(unknown) > 1 else ""
            raise ConfigError(
                f"Unknown config key{plural} {', '.join(map(repr, unknown))}. "
                f"Valid keys: {', '.join(sorted(self.fields))}"
            )
        resolved = {name: f.check(config.get(name, f.default)) for name, f in self.fields.items()}
        for check in self.checks:
            try:
                check(resolved)
            except ConfigError:
                raise
            except ValueError as e:
                raise ConfigError(str(e)) from None
        return resolved

    def define_flags(self, flag_values, names: Iterable[str] | None = None) -> None:
        """absl flags for the fields (all flag fields, or `names`), default
        unset: a flag left unset keeps the config's value."""
        from absl import flags

        for name in self.fields if names is None else names:
            field = self.fields[name]
            if not field.flag:
                continue
            if field.kind == "bool":
                flag = flags.BooleanFlag(name, None, field.describe())
                flag.parser = _BooleanParser(name)
                flags.DEFINE_flag(flag, flag_values)
            else:
                flags.DEFINE_string(name, None, field.describe(), flag_values=flag_values)

    def flag_overrides(self, flag_values) -> dict:
        """{key: value} for the schema's flags set on the command line."""
        overrides = {}
        for name, field in self.fields.items():
            if name not in flag_values or flag_values[name].value is None:
                continue
            value = flag_values[name].value
            overrides[name] = value if field.kind == "bool" else field.parse(value)
        return overrides

    def diff(self, a: Mapping, b: Mapping) -> list[str]:
        """Keys whose values differ between two configs (missing = differs)."""
        keys = set(a) | set(b)
        return sorted(k for k in keys if k not in a or k not in b or a[k] != b[k])


class _BooleanParser:
    """absl's boolean parser with an error that lists the accepted values."""

    def __init__(self, name):
        from absl import flags

        self._parser = flags.BooleanParser()
        self.name = name

    def __getattr__(self, attr):
        return getattr(self._parser, attr)

    def parse(self, argument):
        try:
            return self._parser.parse(argument)
        except ValueError:
            raise ValueError(
                f"`{self.name}` must be true or false (or --{self.name} / --no{self.name})"
            ) from None


def load_file(path: str | pathlib.Path, *args: Any) -> dict:
    """A config from a Python file's `get_config(*args)` or a run folder's
    (or a .json file's) config; every failure is one ConfigError line."""
    path = pathlib.Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(f"--config: no such file {str(path)!r}")
    if path.suffix == ".json":
        return load_json(path)
    namespace = {"__file__": str(path)}
    try:
        exec(compile(path.read_text(), str(path), "exec"), namespace)
        if not callable(namespace.get("get_config")):
            raise ConfigError(f"--config: {path} defines no get_config().")
        config = namespace["get_config"](*args)
    except ConfigError:
        raise
    except Exception as e:  # A user's file: whatever it raises, say where.
        where = f" (line {e.lineno})" if isinstance(e, SyntaxError) else ""
        raise ConfigError(f"--config: {path}{where} failed: {type(e).__name__}: {e}") from None
    if not isinstance(config, dict):
        raise ConfigError(
            f"--config: {path}: get_config() must return a dict. Received: {config!r}"
        )
    return config


def load_json(path: str | pathlib.Path) -> dict:
    """A JSON object from `path`; a corrupt or non-object file is named."""
    path = pathlib.Path(path)
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"Cannot read {str(path)!r}: {e}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{str(path)!r} is not valid JSON ({e}); fix or restore it.") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{str(path)!r} must hold a JSON object. Received: {config!r}")
    return config
