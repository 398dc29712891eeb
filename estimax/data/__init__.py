"""Inputs: arrays, Grain datasets, MNIST idx, TFRecord and ArrayRecord files, Hugging Face datasets,
and the feed that moves batches onto the mesh."""

from estimax.data import idx, tfrecord
from estimax.data.arrayrecord import array_record
from estimax.data.arrays import ArrayDataset, from_arrays
from estimax.data.grain import from_grain
from estimax.data.hf import from_hf
from estimax.data.source import SizedSource, Source

__all__ = [
    "ArrayDataset",
    "SizedSource",
    "Source",
    "array_record",
    "from_arrays",
    "from_grain",
    "from_hf",
    "idx",
    "tfrecord",
]
