"""The wire protocol shared by the server and the worker, and the HTTP client (torch-free)."""
