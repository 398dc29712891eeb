"""Mergeable metrics: sufficient statistics of one batch, merged exactly, computed on the host.

A metric *state* is a small pytree of sufficient statistics, a subclass of
``Metric`` (a frozen dataclass; fields marked ``static()`` such as
``num_classes`` are hashable aux data). It is built from one batch and the
padding mask (``from_batch``), merged associatively and commutatively
(``merge``, whose identity is ``empty``) and turned into numbers on the host in
float64 (``compute``). A model_fn returns metric *inputs* (``Inputs``: the
arrays of one batch and the static config, e.g. ``AUC(scores, labels)``); the
engine builds the states with the mask inside the compiled step, where sums
over the sharded global batch merge every device and host, merges batches in
the evaluation carry and training steps on the host (in int64/float64).

Padding is removed by selection (``where``, integer masks), never by
multiplication, so a NaN in a padded row changes nothing. Owns no I/O and no
device placement.
"""

from estimax.metrics.classification import AUCState, ConfusionState, HitsState
from estimax.metrics.inputs import (
    AUC,
    Accuracy,
    ConfusionMatrix,
    Max,
    Mean,
    Min,
    Std,
    Sum,
    TopK,
    batch_states,
    result_names,
    train_outputs,
)
from estimax.metrics.labels import LOSS_LABELS, LabelRange, check_training, loss_labels, nonfinite_note
from estimax.metrics.protocol import (
    NUM_EXAMPLES,
    Inputs,
    Metric,
    config_of,
    empty_like,
    is_metric_inputs,
    merge_steps,
    results,
    static,
    to_host,
)
from estimax.metrics.states import (
    MaxState,
    MeanState,
    MinState,
    MomentsState,
    SumState,
)

__all__ = [
    "AUC",
    "NUM_EXAMPLES",
    "AUCState",
    "Accuracy",
    "ConfusionMatrix",
    "ConfusionState",
    "HitsState",
    "Inputs",
    "LOSS_LABELS",
    "LabelRange",
    "Max",
    "MaxState",
    "Mean",
    "MeanState",
    "Metric",
    "Min",
    "MinState",
    "MomentsState",
    "Std",
    "Sum",
    "SumState",
    "TopK",
    "batch_states",
    "check_training",
    "config_of",
    "empty_like",
    "is_metric_inputs",
    "loss_labels",
    "merge_steps",
    "nonfinite_note",
    "result_names",
    "results",
    "static",
    "to_host",
    "train_outputs",
]
