"""Communication between data-parallel ranks, torch-free: where ranks sit (topology), what a
collective costs (collectives), what each layout moves (layouts) and how much of it compute
hides (overlap)."""
