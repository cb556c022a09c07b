"""The config's one error type (below every config module, so each can raise it)."""


class ConfigError(ValueError):
    """A bad config value; the message is one line naming the source, the key, the value and what is allowed."""
