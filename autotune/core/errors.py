"""The autotune exception tree. Every error a user can cause has its own class and message.

* AutotuneError
  + SpecError            the spec (or a CLI argument) is invalid; names the field
  + ModelBuildError      the model could not be built (bad factory, hub unreachable, ...)
  |  + FactoryRefused     a worker was not started to allow this factory's module
  + DeviceError          the requested device does not exist or cannot be read

Out-of-memory is *not* an error here: `autotune.engine.devices.device` turns it into `fits=False`.
"""

from __future__ import annotations


class AutotuneError(Exception):
    """Root of every error autotune raises on purpose."""


class SpecError(AutotuneError):
    """The spec or an argument is invalid. The message names the offending field."""


class ModelBuildError(AutotuneError):
    """The model described by a valid spec could not be built."""


class FactoryRefused(ModelBuildError):
    """A factory outside the process's allow-list (`autotune.core.factoryaccess`); nothing was
    imported. Another worker, started with `--allow-factory`, may run it."""


class DeviceError(AutotuneError):
    """The requested device is unavailable or its memory cannot be read."""


_SHOWN_MAX = 24


def shown(value: str) -> str:
    """A piece of user input quoted in a message: a few characters at most, so that a message
    never carries back what was sent (a server answers it to whoever sent it)."""
    return repr(value if len(value) <= _SHOWN_MAX else value[:_SHOWN_MAX] + "...")
