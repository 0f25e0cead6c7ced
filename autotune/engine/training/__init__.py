"""The training run itself: models (the zoo, any model source, LoRA adapters), checkpointing,
optimizers, data-parallel and sharded ranks, and the one training-step kernel."""
