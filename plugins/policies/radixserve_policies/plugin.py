"""Entry-point module: declares the policies; cheap to import (no torch)."""

from radixserve.plugins import hookimpl

PLUGIN_API = ">=1,<2"

_POLICIES = (
    ("fcfs", "fcfs:FCFSPolicy", "first come, first served"),
    ("lpm", "lpm:LPMPolicy", "longest cached prefix first (FCFS above 128 waiting)"),
    ("dfs-weight", "dfs_weight:DFSWeightPolicy", "depth-first over the prefix tree, heaviest subtree first"),
    ("lof", "lof:LOFPolicy", "longest output (max_new_tokens) first"),
    ("priority", "priority:PriorityPolicy", "higher Req.priority first, then arrival"),
    ("random", "random_order:RandomPolicy", "seeded random order (baseline)"),
)


@hookimpl
def radixserve_register(registry) -> None:
    for name, ref, description in _POLICIES:
        registry.register("policy", name, f"radixserve_policies.{ref}", description=description)
