"""The command-line promise every entry point keeps: bad input is one `error:` line and exit status 2.

train, sweep and launch_local share these so that a typo, a config file that does not load
and an impossible setting read the same everywhere, and nothing is written before the check.
"""

import sys

from absl import flags
import ml_collections

BAD_INPUT = 2  # The exit status of bad input (absl and argparse use it for usage errors too).
# absl's help flags print usage and exit 1 while parsing; asking for help is not an error.
_HELP_FLAGS = ("help", "helpshort", "helpfull", "helpxml", "?")


def fail(message: str) -> None:
  """The one way entry points report bad input: a single line and exit status 2."""
  text = " ".join(str(message).replace("\\n", "\n").split()) or "invalid input"
  sys.stderr.write(f"error: {text}\n")
  sys.exit(BAD_INPUT)


def parse_flags(argv: list[str]) -> list[str]:
  """absl's parser, except that bad flags and config files exit 2 with one line instead of 1 with a trace,
  and `--help` (`--helpfull`, ...) exits 0 after printing usage, where absl exits 1."""
  try:
    return flags.FLAGS(argv)
  except SystemExit as exit_:
    if exit_.code == 1 and _asks_for_help(argv):
      sys.exit(0)
    raise
  except flags.UnrecognizedFlagError as error:
    fail(_unknown_flag(error))
  except SyntaxError as error:  # The config file itself does not parse: name the file and line.
    fail(f"cannot load --config: {error.msg} in {error.filename} line {error.lineno}: fix the file")
  except (flags.Error, KeyError, AttributeError, ValueError, TypeError, ImportError, NameError) as error:
    text = str(error)
    if "cannot be added since the config is locked" in text:  # The config file sets a field default.py lacks.
      key = text.split('"')[1] if '"' in text else text
      fail(f"cannot load --config: it sets {key!r}, which is not a config field: fix the spelling in the config "
           "file (configs/default.py lists every field)")
    if "Did you mean" in text or KeyError in (type(error), type(error.__cause__), type(error.__context__)):
      key = text.split("\\n")[0].strip("'\\\" ")
      hint = text[text.index("Did you mean"):].rstrip("'") if "Did you mean" in text else ""
      fail(f"unknown config key {_override_path(argv, key)}: fix the --config.* override. {hint}")
    if "Error whilst parsing config file" in text:  # get_config() raised: its traceback's last line says why.
      fail(f"cannot load --config: get_config() raised {text.strip().splitlines()[-1]}: fix the config file")
    if "has no attribute 'get_config'" in text:
      fail("cannot load --config: the file has no get_config(): pass a configs/*.py that defines one")
    fail(error)


def _asks_for_help(argv: list[str]) -> bool:
  """Whether a flag before `--` is one of absl's help flags (`--help`, `-?`, `--helpfull=true`, ...)."""
  options = argv[1:argv.index("--")] if "--" in argv else argv[1:]
  return any(arg.startswith("-") and arg.lstrip("-").split("=", 1)[0] in _HELP_FLAGS for arg in options)


def _unknown_flag(error: flags.UnrecognizedFlagError) -> str:
  """What to say about an unknown `--NAME`: the `--config.NAME` override it meant when NAME is a field of the
  config, else absl's suggestions. Why: config fields are flags only under their config's prefix, and a
  bare `--outer_steps=3` is the commonest slip."""
  holders = _config_flags_holding(error.flagname)
  if holders:
    value = error.flagvalue.partition("=")[2] or "VALUE"  # absl's flagvalue is the whole argument.
    return (f"unknown flag --{error.flagname}: {error.flagname} is a config field, set it with "
            f"--{holders[0]}.{error.flagname}={value}")
  suggestions = str(error).partition("Did you mean: ")[2].rstrip(" ?")
  hint = f"did you mean {', '.join('--' + s for s in suggestions.split(', '))}? " if suggestions else ""
  return f"unknown flag --{error.flagname}: {hint}--helpfull lists every flag"


def _config_flags_holding(path: str) -> list[str]:
  """The config flags (ml_collections config files) whose config has the dotted field `path`."""
  found = []
  for name in list(flags.FLAGS):
    try:
      config = flags.FLAGS[name].value
    except Exception:  # pylint: disable=broad-except  # A config file that does not load holds no field.
      continue
    for part in path.split("."):
      if not isinstance(config, ml_collections.ConfigDict) or part not in config:
        break
      config = config[part]
    else:
      found.append(name)
  return found


def _override_path(argv: list[str], key: str) -> str:
  """The dotted field of the --config.* override that names `key` (config_flags reports only its last part)."""
  for arg in argv:
    path = arg.split("=", 1)[0].lstrip("-")
    if path.startswith("config.") and key in path.split("."):
      return path.removeprefix("config.")
  return key


def load_config(config_flag):
  """The parsed config of a `config_flags` holder; a config file that does not load is bad input, not a crash."""
  try:
    config = config_flag.value
    config.keys()  # The flag loads lazily: touch it so a broken file fails here.
    return config
  except OSError as error:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    fail(f"cannot load --config ({lines[-1]}): pass an existing configs/*.py with get_config()")
