"""Source templates of generated code.

Each template is a real Python module, so that ruff and mypy check it like the rest of the
package; `autotune.core.exports` reads the templates as text and fills in a recommendation's
numbers. Nothing imports them at run time (they import torch; the exporter does not).
"""
