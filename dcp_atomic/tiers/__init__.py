"""The local tier: node-local saves, replicas on other failure domains, restores from them, and the drain to the
durable root.  Built on the protocol, the stores and the DCP layer; the manager drives it."""
