"""The project's pytest plugin and the plain functions behind it.

``plugin`` is what pytest loads (the ``pytest11`` entry point); ``gpus`` finds out
what the machine offers for CUDA without initializing it; ``global_state``
snapshots and restores torch's process-wide settings and random number generators.
Importing this package does not import torch.
"""
