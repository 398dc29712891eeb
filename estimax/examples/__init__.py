"""Runnable example models used by the CLI and the documentation."""
