"""A ``sitecustomize`` that interrupts rank 0 of a ``torchrun`` job at a given optimizer step.

Put the folder `plant` returns on the training processes' ``PYTHONPATH`` and set:

- ``AT_STEP``: the optimizer step (counted from the start of the process) after which
  rank 0 acts, from an optimizer step post-hook (so between two steps of the loop);
- ``AT_STEP_ACTION``: ``stop``: rank 0 writes its PID into ``AT_STEP_MARKER``, then
  stops itself with SIGSTOP (a job's requeue sends it SIGCONT, then SIGTERM); once
  continued, each of its ``os.fsync`` calls takes 2 s more, as on a slow shared
  filesystem, so the other processes are done with their stop long before rank 0; or
  ``terminate``: rank 0 sends SIGTERM to every PID listed in ``AT_STEP_PIDS`` (the
  ``torchrun`` agents, which forward it to their processes), as an orchestrator would.

Only rank 0 (``RANK=0``, which ``torchrun`` sets for its processes, not for itself)
of a job's first attempt (no ``SLURM_RESTART_COUNT``) acts, so a resumed run trains on
undisturbed. The other ranks wait for rank 0 in the next gradient all-reduce.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

SOURCE = """
    import os

    if os.environ.get("RANK") == "0" and "AT_STEP" in os.environ and (
        "SLURM_RESTART_COUNT" not in os.environ
    ):
        import signal
        import time

        from torch.optim.optimizer import register_optimizer_step_post_hook

        _steps = 0
        # Longer than the other processes take to stop and their torchrun to exit.
        SLOW_FSYNC_SECONDS = 2

        def _at_step(optimizer, args, kwargs):
            global _steps
            _steps += 1
            if _steps != int(os.environ["AT_STEP"]):
                return
            if os.environ["AT_STEP_ACTION"] == "stop":
                with open(os.environ["AT_STEP_MARKER"], "w") as marker:
                    marker.write(str(os.getpid()))
                os.kill(os.getpid(), signal.SIGSTOP)
                fsync = os.fsync

                def slow_fsync(fd):
                    time.sleep(SLOW_FSYNC_SECONDS)
                    fsync(fd)

                os.fsync = slow_fsync
            else:
                listed = os.environ["AT_STEP_PIDS"]
                while not os.path.exists(listed):  # written once every agent is started
                    time.sleep(0.05)
                with open(listed) as pids:
                    for pid in pids.read().split():
                        os.kill(int(pid), signal.SIGTERM)

        register_optimizer_step_post_hook(_at_step)
"""


def plant(directory: Path) -> Path:
    """``directory`` (created) holding the ``sitecustomize.py``, for ``PYTHONPATH``."""
    directory.mkdir()
    (directory / "sitecustomize.py").write_text(textwrap.dedent(SOURCE))
    return directory
