"""Exceptions users can catch. Each message names the bad value and what is valid."""


class TokenswiftError(Exception):
    """Base class of tokenswift's own errors."""


class SpecError(TokenswiftError, ValueError):
    """A spec, preset, component name or option is invalid."""


class ModelLoadError(TokenswiftError, ValueError):
    """A model or tokenizer could not be found or loaded."""


class PluginError(TokenswiftError):
    """A plugin failed to load or registered something invalid."""


class NonFiniteScoresError(TokenswiftError):
    """A node's logits were NaN or +inf, or filtered down to nothing."""


class PromptError(TokenswiftError, ValueError):
    """A prompt cannot be run: empty, not valid Unicode text, ids outside the
    vocabulary, or longer than the model's context."""
