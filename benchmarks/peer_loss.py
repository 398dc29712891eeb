"""How long the survivors of a group take to stop when one process is lost.

Starts N processes on 127.0.0.1 (one CPU device each, gloo collectives) that
run a cross-process sum in a loop, as training does; once every one has
summed, SIGKILLs (or SIGSTOPs) one of them and measures the time until the
last survivor has exited, with their exit codes and whether each printed
estimax's line. The victim is process N-1 by default; ``--victim 0`` shows
what happens when the coordinator itself is lost (JAX aborts the others).
Run: ``python benchmarks/peer_loss.py --processes 2 4 --timeout 10 --repeats 3``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

WORKER = """
from estimax import distributed
distributed.initialize()
import jax, jax.numpy as jnp, numpy as np
mesh = jax.make_mesh((jax.device_count(),), ("i",))
sharding = jax.NamedSharding(mesh, jax.P("i"))
total = jax.jit(jnp.sum)
for i in range(10**9):
    x = jax.make_array_from_process_local_data(sharding, np.ones(1, np.float32))
    float(total(x))
    if i == 0:
        print("ready", flush=True)
"""


def one_loss(processes: int, timeout: float, victim: int, how: signal.Signals) -> dict:
    from estimax.distributed import free_port

    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    port = free_port()
    group = []
    for rank in range(processes):
        env = dict(os.environ, PYTHONPATH=root, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="1")
        env.update(
            ESTIMAX_COORDINATOR=f"127.0.0.1:{port}",
            ESTIMAX_NUM_PROCESSES=str(processes),
            ESTIMAX_PROCESS_ID=str(rank),
            ESTIMAX_PEER_TIMEOUT_SECONDS=str(timeout),
            ESTIMAX_LOG_ALL_PROCESSES="1",
        )
        group.append(
            subprocess.Popen(
                [sys.executable, "-c", WORKER], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    try:
        for p in group:
            if not any(line.startswith("ready") for line in p.stdout):
                raise RuntimeError(p.communicate()[0])
        group[victim].send_signal(how)
        lost = time.monotonic()
        survivors = [r for r in range(processes) if r != victim]
        outs = {r: group[r].communicate()[0] for r in survivors}
        seconds = time.monotonic() - lost
    finally:
        for p in group:
            p.kill()
            p.wait()
    return {
        "seconds": round(seconds, 2),
        "exit_codes": [group[r].returncode for r in survivors],
        "estimax_lines": sum("Stopping with exit code" in out for out in outs.values()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--timeout", type=float, default=10.0, help="ESTIMAX_PEER_TIMEOUT_SECONDS")
    parser.add_argument("--victim", type=int, default=None, help="default: the last process")
    parser.add_argument("--signal", choices=["SIGKILL", "SIGSTOP"], default="SIGKILL")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    for n in args.processes:
        victim = n - 1 if args.victim is None else args.victim
        runs = [one_loss(n, args.timeout, victim, signal.Signals[args.signal]) for _ in range(args.repeats)]
        seconds = [r["seconds"] for r in runs]
        print(
            json.dumps(
                {
                    "processes": n,
                    "timeout": args.timeout,
                    "lost": f"process {victim} ({args.signal})",
                    "seconds_to_last_exit": [min(seconds), max(seconds)],
                    "runs": runs,
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
