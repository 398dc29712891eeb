"""A process that ``estimax launch`` starts in a test (tests/ is on its PYTHONPATH) runs its command in a
warm child of the test's process instead of importing JAX and the rest itself (tests/warm.py, ``hand_over``)."""

import os

# ESTIMAX_RESTART: set by the launcher only (estimax.cli.launch.RESTART_ENV; nothing is imported here)
if os.environ.get("TESTS_WARM_LAUNCH") and "ESTIMAX_RESTART" in os.environ:
    import warm

    warm.hand_over(os.environ["TESTS_WARM_LAUNCH"])
