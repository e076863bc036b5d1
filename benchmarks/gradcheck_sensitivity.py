"""How small a wrong gradient ``gradcheck`` catches, on models initialised as libraries do.

Small random configurations of transformers' Mixtral MoE block (eager and grouped-mm
experts) and Llama decoder (through ``inputs_embeds``), a torch-geometric GCN layer, a
torchdiffeq ODE, a user-style adaptive-computation model and an MLP at std-0.02 init
(the Mixtral, Llama, ACT and MLP models are those of the tests' sensitivity session).
Each is checked as it is (must pass), then with a relative error planted three ways:

- ``input Function``: a custom autograd Function at the input whose backward scales;
- ``parameter hook``: a gradient hook on one parameter that scales its gradient;
- ``module backward``: a custom autograd Function inside one submodule (on its output,
  through a forward hook) whose backward scales, as a wrong ``backward`` in a library
  module would.

at 1% and at 0.1%; then an MLP whose gradients are scaled from 1e-8 to 1e4 (its output
times a constant) with the 1% input Function. Prints per model the good case's verdict,
how many plants each check catches, and the smallest relative error the passing check
says it catches (its sensitivity).

    python benchmarks/gradcheck_sensitivity.py [--src SRC]

Run it with ``--src`` of a project generated before this version for the figures before.
"""

from __future__ import annotations

import argparse
import sys
import time
import types
from functools import partial

from baking import TEMPLATE_DIR, use_generated_src

FACTORS = (1.01, 1.001)
SCALES = (1e-8, 1e-6, 1e-4, 1e-2, 1.0, 1e2, 1e4)


def session():
    """The tests' sensitivity session (``tests/test_plugin_gradcheck_sensitivity.py``) as a
    module: its models, the configurations the tests check."""
    sys.path.insert(0, str(TEMPLATE_DIR / "tests"))
    import test_plugin_gradcheck_sensitivity
    from conftest import DEFAULT_PACKAGE

    module = types.ModuleType("sensitivity_session")
    source = test_plugin_gradcheck_sensitivity.SENSITIVITY.format(package=DEFAULT_PACKAGE)
    exec(source, module.__dict__)
    return module


def models(tested):
    """``name: build()``; ``build`` returns ``(function, inputs, parameter, submodule)``:
    the parameter to hook and the submodule whose output gets the planted Function."""
    import torch
    from torch import nn

    def mixtral(experts):
        block = tested.moe(experts)
        x = torch.randn(1, 5, 8, requires_grad=True)
        return block, (x,), ("experts.down_proj", block), block.experts

    def llama():
        model = tested.llama()
        x = torch.randn(1, 5, 16, requires_grad=True)
        return (
            lambda e: model(inputs_embeds=e).last_hidden_state,
            (x,),
            ("layers.0.mlp.down_proj.weight", model),
            model.layers[0].self_attn,
        )

    def gcn():
        from torch_geometric.nn import GCNConv

        layer = GCNConv(4, 3)
        edges = torch.tensor([[0, 1, 1, 2, 3], [1, 0, 2, 3, 0]])
        x = torch.randn(4, 4, requires_grad=True)
        return (lambda x: layer(x, edges)), (x,), ("lin.weight", layer), layer.lin

    def ode():
        from torchdiffeq import odeint

        field = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 2))
        times = torch.tensor([0.0, 0.5, 1.0])
        y0 = torch.randn(3, 2, requires_grad=True)

        def solve(y):
            return odeint(lambda t, y: field(y), y, times, method="dopri5", rtol=1e-7, atol=1e-9)

        return solve, (y0,), ("0.weight", field), field[0]

    def act():
        model = tested.AdaptiveComputation()
        return model, (torch.randn(2, 6, requires_grad=True),), ("cell.weight", model), model.cell

    def mlp(scale=1.0):
        model = tested.mlp()
        x = torch.randn(3, 8, requires_grad=True)
        return (lambda x: scale * model(x)), (x,), ("2.weight", model), model[0]

    return {
        "Mixtral MoE block, eager experts": lambda: mixtral("eager"),
        "Mixtral MoE block, grouped-mm experts": lambda: mixtral("grouped_mm"),
        "Llama decoder (inputs_embeds)": llama,
        "torch-geometric GCNConv": gcn,
        "torchdiffeq dopri5": ode,
        "adaptive computation (ACT)": act,
        "MLP, std 0.02": mlp,
    }, mlp


def planted(build, how: str, factor: float, scaled):
    """``build``'s function with ``factor`` planted ``how``; ``scaled`` is the tests' identity
    Function whose backward scales by its second argument."""
    function, inputs, (name, owner), submodule = build()
    if how == "input Function":
        original = function

        def function(x, *rest):
            return original(scaled.apply(x, factor), *rest)

    elif how == "parameter hook":
        owner.get_parameter(name).register_hook(lambda grad: factor * grad)
    else:

        def through_scaled(module, args, out):
            if isinstance(out, tuple):
                return (scaled.apply(out[0], factor), *out[1:])
            return scaled.apply(out, factor)

        submodule.register_forward_hook(through_scaled)
    return function, inputs


PLANTS = ("input Function", "parameter hook", "module backward")


def verdict(gradcheck, function, inputs) -> tuple[bool, str]:
    try:
        result = gradcheck(function, *inputs)
    except AssertionError as failure:
        return False, str(failure).splitlines()[0]
    return True, str(result)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", help="a generated project's src folder (default: bake one)")
    args = parser.parse_args()
    use_generated_src(args.src)
    import warnings

    import torch
    from dynamic_model.testing.gradcheck import gradcheck

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    tested = session()
    builds, mlp = models(tested)
    print(f"{'model':<40}{'good':>6}{'1% caught':>11}{'0.1% caught':>13}  sensitivity, seconds")
    for name, build in builds.items():
        torch.manual_seed(0)
        started = time.perf_counter()
        passed, line = verdict(gradcheck, *build()[:2])
        seconds = time.perf_counter() - started
        caught = {}
        for factor in FACTORS:
            count = 0
            for how in PLANTS:
                torch.manual_seed(0)
                ok, _ = verdict(gradcheck, *planted(build, how, factor, tested.Scaled))
                count += not ok
            caught[factor] = count
        sensitivity = line.split("sensitivity: ")[-1][:70] if passed else line[:70]
        print(
            f"{name:<40}{'pass' if passed else 'FAIL':>6}{caught[1.01]:>8} / 3"
            f"{caught[1.001]:>10} / 3  {sensitivity}, {seconds:.2f} s"
        )
    print(f"\n{'MLP output scaled by':<24}{'gradient norm':>14}{'good':>6}{'1% caught':>11}")
    for scale in SCALES:
        torch.manual_seed(0)
        function, inputs, _, _ = mlp(scale)
        norm = float(torch.autograd.grad(function(*inputs).sum(), inputs)[0].norm())
        passed, _ = verdict(gradcheck, function, inputs)
        torch.manual_seed(0)
        ok, _ = verdict(
            gradcheck, *planted(partial(mlp, scale), "input Function", 1.01, tested.Scaled)
        )
        verdicts = f"{'pass' if passed else 'FAIL':>6}{'yes' if not ok else 'no':>11}"
        print(f"{scale:<24g}{norm:>14.2g}{verdicts}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
