"""The estimate's replays: a deep model's step written out from a shallow model's traced one
(layers, partial checkpointing, data-parallel and sharded ranks, ZeRO-1's partition, the
speed pass) and a step of many micro-steps from a traced step of three
(docs/design.md#the-layer-replay, docs/design.md#the-micro-step-replay)."""
