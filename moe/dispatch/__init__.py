"""How the routed experts run: the Execution (what the caller chose: dispatch, kernels, dtype, remat, mesh; its
`auto` choices made per platform in platform.py) and the dispatch paths it picks between.

  execution.py        Execution, validated; `resolved()` makes every `auto` concrete for the platform
  platform.py         what `auto` means on each platform (the one place a platform decides anything)
  experts.py          reference (the loop over experts), dropless (sort + grouped matmul), capacity (GShard)
  expert_parallel.py  shard_map + all_to_all over the mesh's expert axis
  kernels/            the grouped SwiGLU backends (ragged_dot, blocked, slab, tokamax); they never import the above
"""

from moe.dispatch import expert_parallel, experts, kernels
from moe.dispatch.execution import Execution, check_tokens
from plumbing.errors import ConfigError


def routed_experts(ex: Execution, x_TxD, ids_TxK, gates_TxK, w_gate, w_up, w_down, group_size: int, *,
                   gate_input: bool = False, zero_experts: bool = False):
    """sum_k g_{t,k} SwiGLU_{e_{t,k}}(x_t) (gate_input: sum_k SwiGLU_{e_{t,k}}(g_{t,k} x_t)) by `ex.dispatch`: (y_TxD,
    keep_TxK, or None when nothing can be dropped). group_size: the tokens of one capacity group (one sequence).
    zero_experts: ids >= E (w_gate.shape[0]) are zero experts; every path skips them and their g x is added here."""
    y_TxD, keep_TxK = _routed(ex, x_TxD, ids_TxK, gates_TxK, w_gate, w_up, w_down, group_size, gate_input)
    if zero_experts:
        y_TxD = y_TxD + experts.zero_experts(x_TxD, ids_TxK, gates_TxK, w_gate.shape[0])
    return y_TxD, keep_TxK


def _routed(ex, x_TxD, ids_TxK, gates_TxK, w_gate, w_up, w_down, group_size, gate_input):
    if ex.dispatch == "capacity":
        return experts.capacity_with_stats(x_TxD, ids_TxK, gates_TxK, w_gate, w_up, w_down,
                                           capacity_factor=ex.capacity_factor, group_size=group_size,
                                           gate_input=gate_input)
    grouped = kernels.grouped_swiglu_for(ex.grouped_matmul, ex.platform or None)
    if ex.dispatch in ("expert_parallel", "expert_parallel_dropless"):
        if w_gate.shape[0] % ex.expert_shards:
            raise ConfigError(f"execution.dispatch: {ex.dispatch} splits model.n_routed_experts ({w_gate.shape[0]}) "
                              f"over mesh.expert ({ex.expert_shards}); make it divisible")
        check_tokens(ex, x_TxD.shape[0])
        cf = ex.capacity_factor if ex.dispatch == "expert_parallel" else None
        y_TxD, keep_TxK = expert_parallel.dispatch(x_TxD, ids_TxK, gates_TxK, w_gate, w_up, w_down,
                                                   mesh=ex.mesh, capacity_factor=cf, grouped_matmul=grouped,
                                                   permute=ex.permute_grad, gate_input=gate_input)
        return y_TxD, keep_TxK if cf is not None else None
    if ex.dispatch == "reference":
        return experts.reference(x_TxD, ids_TxK, gates_TxK, w_gate, w_up, w_down, gate_input=gate_input), None
    return experts.dropless(x_TxD, ids_TxK, gates_TxK, w_gate, w_up, w_down, grouped=grouped,
                            constrain=ex.constrain, permute=ex.permute_grad, gate_input=gate_input), None


__all__ = ["Execution", "routed_experts"]
