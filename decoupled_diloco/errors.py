"""The one exception type that means "the user asked for something impossible".

Entry points catch it, print its one-line message (which names the fix) and exit with
status 2 before anything is written to the workdir.
"""


class ConfigError(ValueError):
  """A bad config value, missing file or dataset, or impossible device layout."""
