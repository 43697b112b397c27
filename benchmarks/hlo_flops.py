"""The matmul FLOPs an optimized XLA program executes, read from its HLO text (`jax.stages.Compiled.as_text()`).

Every `dot` counts 2 x (output elements) x (contracted size), wherever it sits: in the entry computation, in a
fusion (XLA:GPU's Triton GEMMs, XLA:CPU's loop fusions), in a while loop's body (times the loop's
`known_trip_count`; a loop without one counts once) or in one branch of a conditional (`branch`: which branch runs;
slab's layout switch lists its layouts cheapest first, so branch 0 is a routing that fits the smallest slab).
XLA's own cost analysis is not available for a program compiled without its device, and counts a loop body once.
cuBLAS GEMMs (custom calls, chosen by autotuning on a GPU) are not counted: a deviceless compile has none.
"""

import math
import re

_COMPUTATION = re.compile(r"^(?:ENTRY )?%(\S+) .*\{$")
_DEFINITION = re.compile(r"^\s*(?:ROOT )?%(\S+) = (\w+)\[([\d,]*)\]")
_DOT = re.compile(r"^\s*(?:ROOT )?%\S+ = \w+\[([\d,]*)\]\S* dot\(%(\S+), %(\S+)\).*lhs_contracting_dims=\{([\d,]*)\}")
_CALLS = re.compile(r"(?:calls|body|to_apply)=%([\w.-]+)")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")


def _dims(text: str) -> list[int]:
    return [int(d) for d in text.split(",") if d]


def computations(hlo: str) -> dict[str, list[str]]:
    """The program's computations by name, each a list of its instruction lines."""
    out, current = {}, None
    for line in hlo.splitlines():
        m = _COMPUTATION.match(line)
        if m:
            current = out.setdefault(m.group(1), [])
        elif line.startswith("}"):
            current = None
        elif current is not None:
            current.append(line)
    return out


def entry_name(hlo: str) -> str:
    return next(line.split()[1][1:] for line in hlo.splitlines() if line.startswith("ENTRY "))


def matmul_flops(hlo: str, branch: int = 0) -> float:
    """FLOPs of every dot the program runs once (see the module docstring)."""
    comps = computations(hlo)
    cache: dict[str, float] = {}

    def flops(name: str) -> float:
        if name in cache:
            return cache[name]
        cache[name] = 0.0  # a (malformed) cycle counts once
        shapes = {m.group(1): _dims(m.group(3)) for m in map(_DEFINITION.match, comps.get(name, [])) if m}
        total = 0.0
        for line in comps.get(name, []):
            dot = _DOT.match(line)
            if dot:
                out, lhs, contracting = _dims(dot.group(1)), shapes.get(dot.group(2)), _dims(dot.group(4))
                if lhs is not None:
                    total += 2 * math.prod(out) * math.prod(lhs[i] for i in contracting)
                continue
            trip = _TRIP.search(line)
            for callee in _CALLS.findall(line):
                total += flops(callee) * (int(trip.group(1)) if trip and "body=%" + callee in line else 1)
            branches = _BRANCHES.search(line)
            if branches:
                names = [b.strip().lstrip("%") for b in branches.group(1).split(",")]
                total += flops(names[min(branch, len(names) - 1)])
        cache[name] = total
        return total

    return flops(entry_name(hlo))
