"""The torch-free core: the spec, the search, the candidate arithmetic, result checks and exports.

Nothing here imports torch, optuna or numpy (tests/test_no_torch.py imports every module of
this folder in a fresh interpreter and checks), so the server and the client can use it.
"""
