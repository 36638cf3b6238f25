"""The local tier: node-local saves, replicas on other failure domains, restores from them, and the drain to the
durable root.  Built on the protocol, the stores and the DCP layer; the manager drives it."""

from .._base.faces import face

# The face: what the other layers import from here (tests/guards/test_layers.py holds them to it), by module.  All of
# it is for manager/two_tier.py (the CLI uses local_markers, open_local and sweep_spool too): the seam to narrow.
__all__, __getattr__, __dir__ = face(__name__, {
    "drain": ("Drained", "Drainer"),
    "drain_plan": ("DrainJob",),
    "local_tier": ("commit_local", "local_markers", "LocalWriter", "merge_held", "of_lineage", "open_local",
                   "read_manifest", "remove_failed_attempt", "remove_local_step", "retain_local", "scan_root", "sweep_spool",
                   "Topology"),
    "placement": ("failure_domain",),
    "tier_restore": ("assemble_step", "choose_restore", "DurableCandidate", "expand_stateful", "restore_not_found"),
})
