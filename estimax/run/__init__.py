"""The run's durable side: its directory, saves, checkpoints, their schedule and pruning, the writer lock
and lease, the follower's holds, the run's setup and computation, where its state starts (warm start),
and resuming in another shape."""
