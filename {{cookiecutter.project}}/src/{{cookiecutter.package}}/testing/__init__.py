"""The project's pytest plugin, its checks, and the shared floor they stand on.

``plugin`` is what the project's pytest configuration loads (``-p
<package>.testing.plugin`` in ``addopts``): hooks and fixtures, thin, importing each
check only when its fixture is used. The checks, each behind the fixture of its
name and each a plain function too, are peers: ``gradcheck``, ``determinism``
(``autograd_determinism``), ``compile_check``, ``export_check``, ``training_check``,
``ddp_check`` and ``finite_check``; ``decisions`` (``pytest --decisions``) is on the floor, as every
process a check starts records into it. They import the modules of
:data:`SHARED_FLOOR` and never each other (``tests/test_architecture.py`` checks it).
ARCHITECTURE.md at the project's root says which module does what. Importing this
package does not import torch.
"""

__all__ = ["SHARED_FLOOR"]

# What every check may import: no check owns these modules. Any other module in this
# package except ``plugin`` is a check.
SHARED_FLOOR = frozenset(
    {
        "branches",  # inputs on the other side of each branch decision
        "calls",  # the call a check makes: options, forward_kwargs, input sets, modules reached
        "comparison",  # two results compared, bit for bit or within tolerances
        "control_flow",  # data-dependent decisions recorded, with the user's line
        "data_dependence",  # where a data-dependent size or value is made, and where used
        "decisions",  # decision coverage, recorded in every process a check starts
        "failures",  # CheckFailure, the base of every check's failures
        "float64",  # a forward kept in float64 end to end
        "frames",  # whose code a frame runs; the user's line and the library lines under it
        "global_state",  # torch's process-wide settings and RNGs: snapshot, compare, restore
        "nonfinite",  # where the first NaN or inf of a run was born: the op, its values, why
        "naming",  # names of callables, inputs and tensor elements in reports
        "op_sites",  # where an aten op runs: the submodule, the user's line, the forward call
        "options",  # a check's options checked, refused in one line naming check and option
        "parameter_use",  # parameters a forward reaches, and the decisions that decide it
        "parts",  # the autograd Functions and submodule calls of one forward, with their inputs
        "processes",  # a child process run to a deadline, killed with its group, its stack read
        "python_attributes",  # plain Python attributes of modules: snapshot, changes, lines
        "rewrites",  # the rewrite that takes a data-dependent decision out of Python
        "sources",  # a source file parsed once: nodes, parents, expressions by span
        "runs",  # one forward and backward, its cotangents and typed results
        "subject",  # the model or function under test and the state each run starts from
        "torch_logs",  # torch's own log records kept out of a check's report
        "torch_text",  # torch's error text without symbolic-shape internals
        "trees",  # nested inputs and outputs through torch.utils._pytree
        "verified_rewrites",  # a rewrite built, exported and compared with eager
    }
)
