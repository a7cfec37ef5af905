"""Typed config groups: each `config.<group>` sub-tree becomes one frozen dataclass, validated once.

A group (`inner.Settings`, `outer.Settings`, `policy.Settings`, `fragments.Streaming`,
`compression.Codec`, `service.settings.Settings`, `data.settings.Settings`, `model.sizing.Settings`,
`syncer.Settings`) lives beside the code that uses it and checks its own fields in its
constructor; `experiment.validate` builds them all and adds the rules that span groups.
This module holds what they share: building a dataclass from a `ConfigDict` so that a
field the group does not have is refused by name, never stored and silently ignored, and
the `Groups` bundle `experiment.validate` returns.

`configs/default.py` also locks its config, so a typo in a config file or a `--config.*`
flag fails when the config loads, before any of this runs.
"""

import dataclasses
import difflib
from typing import Any

from decoupled_diloco.errors import ConfigError


def refuse_unknown(cfg, group: str, known) -> None:
  """Refuses keys of `cfg` outside `known`, naming the first one and the closest known field."""
  unknown = sorted(set(cfg.keys()) - set(known))
  if unknown:
    close = difflib.get_close_matches(unknown[0], sorted(known), n=1)
    hint = f"did you mean {group}.{close[0]}? " if close else ""
    raise ConfigError(f"{group}.{unknown[0]} is not a config field: {hint}fix or drop it (configs/default.py "
                      f"lists every field of config.{group})")


def from_config(cls, cfg, group: str, extra_keys=()):
  """`cls(**cfg)` for a frozen dataclass `cls`: every key must be one of its fields (or `extra_keys`).

  Fields the sub-tree leaves out take the dataclass default; a field without a default that
  is missing is refused too. `cfg` may already be a `cls` (code that holds the typed group).
  """
  if isinstance(cfg, cls):
    return cfg
  names = [f.name for f in dataclasses.fields(cls) if f.init]
  refuse_unknown(cfg, group, (*names, *extra_keys))
  missing = [
      f.name for f in dataclasses.fields(cls)
      if f.init and f.name not in cfg and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
  if missing:
    raise ConfigError(f"config.{group} lacks {group}.{missing[0]}: start the config from configs/default.py, "
                      "which sets every field")
  return cls(**{name: cfg[name] for name in names if name in cfg})


def check(checks) -> None:
  """Raises the message of the first (ok, message) pair that is not ok: a group's constructor checks."""
  for ok, message in checks:
    if not ok:
      raise ConfigError(message)


def is_int(value) -> bool:
  """An int that is not a bool: counts and sizes, where True would pass as 1."""
  return isinstance(value, int) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class Groups:
  """Every typed group of one validated config; what `experiment.validate` returns."""
  model: Any
  data: Any
  inner: Any
  outer: Any | None  # None in mode 'ddp' (no outer loop).
  syncer: Any | None  # None in mode 'ddp'.
  streaming: Any | None  # None in mode 'ddp'.
  compression: Any | None  # None in mode 'ddp'.
  policy: Any
  failures: Any | None  # None when failures are off.
  service: Any | None  # None unless runtime='service'.
