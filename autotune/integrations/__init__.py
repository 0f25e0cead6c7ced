"""autotune inside the trainers people use: `autotune.integrations.transformers` (a
`TrainingArguments` with the tuned batch) and `autotune.integrations.lightning` (a callback in
place of `BatchSizeFinder`). Each module imports its trainer only when used."""
