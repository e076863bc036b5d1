"""The project's pytest plugin and the plain functions behind it.

``plugin`` is what the project's pytest configuration loads (``-p
<package>.testing.plugin`` in ``addopts``); ``global_state`` snapshots and restores
torch's process-wide settings and random number generators; ``determinism`` and
``gradcheck`` are the checks behind the ``autograd_determinism`` and ``gradcheck``
fixtures, and ``control_flow`` records the data-dependent decisions both report.
The GPU and driver facts the plugin decides on are in ``<package>.gpus``.
Importing this package does not import torch.
"""
