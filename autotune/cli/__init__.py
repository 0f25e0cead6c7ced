"""The `autotune` command: its entry point, shared options and the library's own commands."""
