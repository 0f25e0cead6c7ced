"""The probe worker: `autotune worker` claims runs from the server and tunes each on this
machine, every trial in a fresh child process (`probes.worker`, `probes.isolation`)."""

from __future__ import annotations
