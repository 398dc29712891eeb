"""Inputs: arrays, Grain datasets, MNIST idx and TFRecord files, and the feed that moves batches onto the mesh."""

from estimax.data import idx, tfrecord
from estimax.data.arrays import ArrayDataset, from_arrays
from estimax.data.grain import from_grain

__all__ = ["ArrayDataset", "from_arrays", "from_grain", "idx", "tfrecord"]
