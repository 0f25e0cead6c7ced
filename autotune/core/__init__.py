"""The torch-free core: pure models and rules that the torch side and the server both use."""
