"""Checks before and around a call: the model_fn and hooks, each mode traced abstractly, one call at a
time, and a model_fn's errors on the input retold."""
