"""User-facing errors: anything the user can fix (a bad checkpoint, a bad prompt, a bad flag).

The CLI and the server turn a `UserError` into one clear message and a non-zero exit / a 4xx
answer; any other exception is a bug in megastep and keeps its traceback.
"""


class UserError(Exception):
    """A problem with the user's input, reported as one message without a traceback."""


class CheckpointError(UserError):
    """The checkpoint on disk does not match what its config promises."""


class ConfigError(UserError):
    """config.json is missing, malformed or describes a model megastep does not run."""
