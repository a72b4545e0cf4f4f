"""A tensor-parallel group: forming it through the nodes' control plane, rank 0's step
commands, the ranks' side, and the server engine over the group."""
