"""Inputs: in-memory arrays and the feed that moves batches onto the mesh."""

from estimax.data.arrays import ArrayDataset, from_arrays

__all__ = ["ArrayDataset", "from_arrays"]
