"""The torch side. Orchestration lives here (the probe, the tuner, its study, trial runners and
estimates); `devices/`, `emulation/` and `training/` hold what it orchestrates."""
