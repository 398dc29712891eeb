"""Checks before and around a call: the model_fn and hooks, each mode traced abstractly, what a model_fn
returns, one call at a time, a model_fn's errors on the input retold, and the type and range of one
setting's value."""
