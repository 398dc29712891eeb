"""The group of processes: who belongs to it (clusters), a lost peer named (peers), preemption."""
