"""What each text of `render_exports` is called wherever it is shown (the CLI, the run page)."""

from __future__ import annotations

EXPORT_TITLES = {
    "hf": "Hugging Face TrainingArguments",
    "axolotl": "Axolotl",
    "deepspeed": "DeepSpeed",
    "deepspeed_notes": "DeepSpeed: what the JSON cannot say",
    "lightning": "Lightning",
    "pytorch_loop": "Plain PyTorch loop",
    "data_parallel": "Data parallel",
}
