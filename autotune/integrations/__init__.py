"""autotune inside the trainers people use: `autotune.integrations.transformers` (a
`TrainingArguments` with the tuned batch). Each module imports its trainer only when used."""
