"""Blocking service calls from async views: see :mod:`runtime.aio`."""

from runtime.aio import blocking

__all__ = ["blocking"]
