"""Errors of the model library. Plain exceptions (the library imports no service framework); services wrap
them into their own error hierarchy at their edge."""

from __future__ import annotations


class ModelError(Exception):
    """Base of every error this library raises on purpose."""


class UnsupportedModelError(ModelError):
    """The checkpoint's architecture or a feature of it is not implemented here."""


class WeightsError(ModelError):
    """Weights do not fit the model: unknown names, wrong shapes, missing tensors, unreadable files."""
