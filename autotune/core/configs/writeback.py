"""A recommendation put back into the file it was read from: the micro-batch, the accumulation
and the checkpointing flag under the file's own key names (the exports' tables), and a layout
the options chose (`layout_writeback`), everything else kept. YAML goes through ruamel.yaml's
round trip (comments, key order and quoting kept); JSON, which has no comments, is written back
in its key order with its indentation.
"""

from __future__ import annotations

import difflib
import io
import json
import re
from typing import Any

from autotune.core.configs.conversion import ConfigFormat, Converted
from autotune.core.configs.edits import apply_edits
from autotune.core.configs.layout_writeback import layout_settings
from autotune.core.exports.axolotl import AXOLOTL_KEYS
from autotune.core.exports.deepspeed import DEEPSPEED_KEYS
from autotune.core.exports.hf import HF_KEYS, hf_checkpointing_key
from autotune.core.schemas import Exports, Recommendation

_HF_CHECKPOINTING_KEYS = ("activation_checkpointing", "gradient_checkpointing")


def recommended_settings(
    converted: Converted, rec: Recommendation, exports: Exports
) -> tuple[dict[str, Any], list[str]]:
    """The keys to set in the file and their values, and what the file cannot say."""
    notes: list[str] = []
    partial = rec.checkpointing and rec.checkpointed_blocks is not None
    if converted.format is ConfigFormat.AXOLOTL:
        keys = [AXOLOTL_KEYS[name] for name in ("micro_batch", "accumulation", "checkpointing")]
        settings = {key: exports.axolotl[key] for key in keys}
    elif converted.format is ConfigFormat.HF_ARGS:
        settings = {
            HF_KEYS[name]: exports.hf[HF_KEYS[name]] for name in ("micro_batch", "accumulation")
        }
        # transformers 5 writes both names (the old one an alias): set every one present, so
        # that neither turns checkpointing on against the recommendation.
        present = [key for key in _HF_CHECKPOINTING_KEYS if key in converted.data]
        for key in present or [hf_checkpointing_key(exports.transformers_version)]:
            settings[key] = rec.checkpointing
    elif converted.format is ConfigFormat.DEEPSPEED:
        names = ("global_batch", "micro_batch", "accumulation")
        settings = {
            DEEPSPEED_KEYS[name]: exports.deepspeed[DEEPSPEED_KEYS[name]] for name in names
        }
        if rec.checkpointing:
            notes.append(
                "checkpointing: on, which a DeepSpeed config cannot say: enable it on your model "
                "(e.g. model.gradient_checkpointing_enable())"
            )
    else:
        raise ValueError("a spec file has no settings to write back")
    layout, layout_notes = layout_settings(converted, rec, exports)
    settings.update(layout)
    notes += layout_notes
    if partial and converted.format is not ConfigFormat.DEEPSPEED:
        notes.append(
            f"checkpointing: measured on the first {rec.checkpointed_blocks} blocks; the file's "
            "flag checkpoints every block (the same memory or less, more recompute)"
        )
    return settings, notes


def rewritten(converted: Converted, original: str, settings: dict[str, Any]) -> str:
    """`original` (the file's text) with `settings` made to it (`autotune.core.configs.edits`:
    set, merged into a nested mapping, or removed); keys it lacks are added at the end."""
    if converted.path.suffix == ".json":
        data = json.loads(original)
        apply_edits(data, settings)
        return json.dumps(data, indent=_json_indent(original)) + (
            "\n" if original.endswith("\n") else ""
        )
    return _rewritten_yaml(original, settings)


def _json_indent(text: str) -> int | None:
    match = re.search(r"\n( +)\S", text)
    return len(match.group(1)) if match else None


def _rewritten_yaml(original: str, settings: dict[str, Any]) -> str:
    from ruamel.yaml import YAML

    yaml = YAML(typ="rt")
    yaml.preserve_quotes = True
    yaml.width = 4096  # never re-wrap a long line
    mapping_indent, sequence_indent, offset = _yaml_indents(original)
    yaml.indent(mapping=mapping_indent, sequence=sequence_indent, offset=offset)
    data = yaml.load(original)
    apply_edits(data, settings)
    out = io.StringIO()
    yaml.dump(data, out)
    return out.getvalue()


def _yaml_indents(text: str) -> tuple[int, int, int]:
    """The file's block indentation (ruamel applies one setting to the whole file): the
    indent of a nested mapping, and of a list under a key with its dash's offset."""
    mapping = 2
    found = re.search(r"^[^\s#][^\n]*:[ \t]*\n( +)[^\s\-#]", text, re.MULTILINE)
    if found:
        mapping = len(found.group(1))
    found = re.search(r"^( *)[^\s#][^\n]*:[ \t]*\n( *)- ", text, re.MULTILINE)
    if not found:
        return mapping, mapping, 0
    offset = len(found.group(2)) - len(found.group(1))
    return mapping, offset + 2, offset


def unified_diff(before: str, after: str, name: str) -> str:
    return "".join(
        difflib.unified_diff(
            before.splitlines(keepends=True),
            after.splitlines(keepends=True),
            fromfile=f"{name} (before)",
            tofile=f"{name} (recommended)",
        )
    )
