"""A model's text configuration: the one place that resolves it."""

from __future__ import annotations


def text_config(config):
    """The decoder's configuration within ``config`` (a transformers ``PretrainedConfig``,
    or a model, whose ``config`` is used): a multimodal model's text part, or the
    config itself."""
    config = getattr(config, "config", config)
    return config.get_text_config() if hasattr(config, "get_text_config") else config
