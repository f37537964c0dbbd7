"""The distributed layer: meshes, FSDP2 training layout, train -> generate resharding, placement.

Everything here is a no-op or an identity on a single process, so notebook code runs unchanged;
under ``rlkit.launch`` / torchrun the same calls shard and move weights across processes.
"""
from rlkit.parallel.agree import FailedOnAnotherRank, RanksDisagreeError, check_models_agree, check_ranks_agree
from rlkit.parallel.fsdp import (
    decoder_layers,
    full_state_dict,
    global_sum,
    load_full_state_dict,
    set_gradient_reduction,
    set_gradient_sync,
    shard_model,
    unsharded,
)
from rlkit.parallel.mesh import (
    World,
    barrier,
    device_mesh,
    in_mesh,
    init_distributed,
    mesh_ranks,
    role_mesh,
    shutdown,
    split_ranks,
    world,
)
from rlkit.parallel.placement import (
    ROLES,
    Placement,
    colocated_placement,
    gather_rows,
    local_placement,
    shard_reward,
    shard_rows,
    split_placement,
)
from rlkit.parallel.reshard import Layout, SyncReport, gather_weights, replicated, split, tensor_parallel, tp_style

__all__ = [
    "FailedOnAnotherRank", "RanksDisagreeError", "check_models_agree", "check_ranks_agree",
    "World", "barrier", "device_mesh", "in_mesh", "init_distributed", "mesh_ranks", "role_mesh", "shutdown",
    "split_ranks", "world",
    "decoder_layers", "full_state_dict", "global_sum", "load_full_state_dict", "set_gradient_reduction",
    "set_gradient_sync", "shard_model", "unsharded",
    "Layout", "SyncReport", "gather_weights", "replicated", "split", "tensor_parallel", "tp_style",
    "ROLES", "Placement", "colocated_placement", "gather_rows", "local_placement", "shard_reward", "shard_rows",
    "split_placement",
]
