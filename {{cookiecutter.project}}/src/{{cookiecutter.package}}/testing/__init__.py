"""The project's pytest plugin and the plain functions behind it.

``plugin`` is what the project's pytest configuration loads (``-p
<package>.testing.plugin`` in ``addopts``); ``global_state`` snapshots and restores
torch's process-wide settings and random number generators; ``determinism`` and
``gradcheck`` are the checks behind the ``autograd_determinism`` and ``gradcheck``
fixtures, with ``calls`` (how a callable's arguments and modules are found and
named), ``float64`` (the mode that keeps a forward in float64) and ``branches``
(inputs on the other side of each branch decision); ``compile_check`` and
``export_check`` are behind the fixtures of the same names (``torch.compile``
parity, ``torch.export`` readiness); ``control_flow`` records the data-dependent
decisions they all report, and ``decisions`` counts them for ``pytest --decisions``.
The GPU and driver facts the plugin decides on are in ``<package>.gpus``. Importing
this package does not import torch.
"""
