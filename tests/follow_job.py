"""The trainer and the follower of the follow tests, each a process of its own.

``python tests/follow_job.py train MODEL_DIR MAX_STEPS KEEP``: trains the tests' MLP, 2 steps per
loop, a checkpoint every 2 steps keeping KEEP; ``SLOW_SECONDS`` makes each loop last at least that
long. It prints "trained to step N" at its end; SIGTERM saves and exits 75.

``python tests/follow_job.py follow MODEL_DIR [--newest-only]``: follows the run with
``Estimator.follow`` (polling every ``POLL_SECONDS``, 0.1 by default, a hold of ``HOLD_SECONDS``,
3 by default) on 4 devices (the trainer uses 8: the follower restores into another mesh), then prints its records as
one JSON line. Faults, by variable: ``KILL_IN_RESTORE=N`` SIGKILLs it inside the restore of step N,
``KILL_IN_RECORD=N`` half-way through writing the record of step N; ``SLOW_RESTORE`` sleeps that
long before each restore; ``EXPORT_BASE`` keeps the best by loss and exports it there (2 versions).
It prints "following" once it has taken its hold. An estimax error
ends it as the ``estimax`` command does: one line, and the error's exit code.
"""

import json
import os
import signal
import sys
import time

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from models import blobs, estimator  # noqa: E402

import estimax as ex  # noqa: E402
from estimax import follow  # noqa: E402
from estimax.run import checkpoint, holds

EVAL = 96  # examples of the evaluation input (3 batches of 32)


def eval_input():
    features, labels = blobs(256)
    return ex.data.from_arrays({"x": features["x"][:EVAL]}, labels[:EVAL])


class Slow(ex.Hook):
    def after_loop(self, loop):
        time.sleep(float(os.environ.get("SLOW_SECONDS", 0)))


def train(model_dir: str, max_steps: int, keep: int) -> None:
    est = estimator(
        model_dir,
        steps_per_loop=2,
        log_every_steps=2,
        checkpoint=ex.CheckpointPolicy(every_steps=2, max_overhead=None, keep=keep),
    )
    est.train(ex.data.from_arrays(*blobs(256)), max_steps=max_steps, hooks=[Slow()])
    print(f"trained to step {est.step}", flush=True)


def faults() -> None:
    restore, append = checkpoint.Checkpointer.restore, follow.Records.append
    kill_in_restore = int(os.environ.get("KILL_IN_RESTORE", -1))
    kill_in_record = int(os.environ.get("KILL_IN_RECORD", -1))

    def slow_restore(self, abstract_state, step=None):
        time.sleep(float(os.environ.get("SLOW_RESTORE", 0)))
        if step == kill_in_restore:
            os.kill(os.getpid(), signal.SIGKILL)
        return restore(self, abstract_state, step)

    def cut_record(self, record):
        if record["step"] == kill_in_record and not self.path.startswith(("gs://", "s3://")):
            with open(self.path, "a") as f:
                f.write(json.dumps(record)[:20])  # the record, cut short
                f.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        return append(self, record)

    checkpoint.Checkpointer.restore, follow.Records.append = slow_restore, cut_record


def follow_run(model_dir: str, newest_only: bool) -> None:
    faults()
    take = holds.Hold.take

    def announced(self, floor):
        take(self, floor)
        print("following", flush=True)

    holds.Hold.take = announced
    est = estimator(model_dir, num_devices=4, eval_batch_size=32)
    hold = float(os.environ.get("HOLD_SECONDS", 3))
    poll = float(os.environ.get("POLL_SECONDS", 0.1))
    policy = ex.FollowPolicy(newest_only=newest_only, poll_seconds=poll, hold_seconds=hold)
    best = ex.Best("loss") if "EXPORT_BASE" in os.environ else None
    export = ex.serving.ExportBase(os.environ["EXPORT_BASE"], keep=2) if best else None
    records = est.follow(eval_input(), best=best, export=export, policy=policy)
    print(json.dumps(records), flush=True)


if __name__ == "__main__":
    try:
        if sys.argv[1] == "train":
            train(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
        else:
            follow_run(sys.argv[2], "--newest-only" in sys.argv)
    except ex.EstimaxError as error:
        print(f"estimax: error: {' '.join(str(error).split())}", file=sys.stderr, flush=True)
        sys.exit(getattr(error, "exit_code", 2))
