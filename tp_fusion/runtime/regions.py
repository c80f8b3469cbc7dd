"""Generated kernels for the elementwise work of compute segments (``torch.compile``).

nvFuser generates one kernel for a chain of pointwise ops and reductions; run op by op through aten,
the same chain makes one pass over memory per op (a decomposed layer norm: eight). So the runner
hands each *region* of a compute segment (consecutive pointwise, reduction, normalization and view
ops, at least two of them) to ``torch.compile``, which fuses it into a few kernels. GEMMs,
attention, factories (random numbers) and collectives stay between regions, run as before.

A region's inputs are the values it reads that it does not produce; its outputs, the values it
produces that anything after it reads (later steps or segments, or the program's outputs). Each
region gets its own code object, so torch's compile cache holds one entry per region. Compiling
happens at a region's first run; a region that fails to compile runs op by op from then on.

``TP_FUSION_COMPILE``: ``1`` compiles, ``0`` (the default) runs op by op, ``eager`` traces regions
without generating code (tests). Off by default because it does not pay yet: on 2x H200 (bf16,
``benchmarks/transformer_layer.py``, the GPT layer of ``examples/transformer_layer.py``) the forward
went from 3.81 to 4.73 ms (sp, 8192 tokens, hidden 4096) and from 12.92 to 12.41 ms (sp, hidden
8192), tp from 5.09 to 4.64 and from 14.62 to 14.18 ms; and each region compiles at its first run
(seconds per plan).
"""

from __future__ import annotations

import os
import types
import warnings
from collections.abc import Callable

import torch

from tp_fusion.ir import symbols_of
from tp_fusion.ops import OPS, Trait, traits
from tp_fusion.program import Compute

FUSIBLE = Trait.POINTWISE | Trait.REDUCTION | Trait.NORMALIZATION | Trait.VIEW
MIN_OPS = 2


def mode() -> str:
    """``"inductor"``, ``"eager"`` (trace only) or ``""`` (op by op), from ``TP_FUSION_COMPILE``."""
    setting = os.environ.get("TP_FUSION_COMPILE", "0")
    return {"1": "inductor", "eager": "eager"}.get(setting, "")


def fusible(step) -> bool:
    """Whether a step may join a region: a local pointwise/reduction/view op (no factory, GEMM,
    attention or collective) whose attributes are fixed in the plan."""
    if not isinstance(step, Compute) or not step.runs_here:
        return False
    t = traits(step.op.kind)
    return bool(t & FUSIBLE) and not t & (Trait.FACTORY | Trait.COLLECTIVE | Trait.LOCAL_RESHARD) \
        and not symbols_of(step.attrs)  # a number read per call would be compiled in as a constant


def split(steps: tuple, fusible_step: Callable = fusible) -> list[tuple[bool, list]]:
    """``steps`` cut into maximal runs: (True, a region of at least ``MIN_OPS`` fusible steps) or
    (False, steps run one by one)."""
    runs: list[tuple[bool, list]] = []
    for step in steps:
        ok = fusible_step(step)
        if runs and runs[-1][0] == ok:
            runs[-1][1].append(step)
        else:
            runs.append((ok, [step]))
    out: list[tuple[bool, list]] = []
    for ok, run in runs:
        ok = ok and len(run) >= MIN_OPS
        if out and not ok and not out[-1][0]:
            out[-1][1].extend(run)
        else:
            out.append((ok, run))
    return out


def region(steps: list[Compute], read_later: Callable[[int], bool], how: str) -> Callable[[dict], None]:
    """``run(env)`` for a region: its inputs from ``env``, its outputs (the values ``read_later``)
    into ``env``, computed by one compiled function."""
    produced = {o for s in steps for o in s.op.outputs}
    inputs = list(dict.fromkeys(a for s in steps for a in s.op.inputs if isinstance(a, int) and a not in produced))
    outputs = [o for s in steps for o in s.op.outputs if read_later(o)]
    plan = [(s.op.kind, dict(s.attrs), [(a, False) if isinstance(a, int) else (a.value, True) for a in s.op.inputs],
             s.op.outputs) for s in steps]

    def body(*args):
        env = dict(zip(inputs, args))
        for kind, attrs, operands, outs in plan:
            result = OPS[kind].impl(*[v if const else env[v] for v, const in operands], **attrs)
            if len(outs) == 1:
                env[outs[0]] = result
            else:
                env.update(zip(outs, result))
        return tuple(env[o] for o in outputs)

    # A code object of its own: torch.compile caches per code object.
    name = f"tp_fusion_region_T{outputs[0] if outputs else steps[0].op.outputs[0]}"
    own = types.FunctionType(body.__code__.replace(co_name=name), body.__globals__, name, None, body.__closure__)
    state = {"fn": None}

    def run(env):
        args = [env[i] for i in inputs]
        if state["fn"] is None:
            state["fn"] = torch.compile(own, backend="inductor" if how == "inductor" else "eager", dynamic=False)
            try:
                results = state["fn"](*args)
            except Exception as e:  # not compilable: run op by op from now on
                warnings.warn(f"tp_fusion: {name} ({len(steps)} ops) runs op by op: torch.compile failed: "
                              f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", stacklevel=2)
                state["fn"] = body
                results = body(*args)
        else:
            results = state["fn"](*args)
        env.update(zip(outputs, results))
    return run
