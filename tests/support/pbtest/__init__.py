"""Test support for piecewise_backend's suite: tiny models and ops, a CPU double of torch.cuda,
a multi-rank harness. On pytest's ``pythonpath`` under a name of our own (see pyproject.toml)."""
