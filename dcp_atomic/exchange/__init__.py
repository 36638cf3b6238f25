"""Rank to rank: the liveness heartbeat, typed collectives that name the rank that failed, and the one transport
of bytes between ranks (:mod:`.transport`) with what it carries: shared reads (:mod:`.read_once`) and file streams
(:mod:`.file_transfer`)."""

from .._base.faces import face
from .read_once import *  # noqa: F401,F403 - the names of the former module dcp_atomic.exchange, for one release
from .transport import PastTheGather, PeerError, PeerLink, PeerLost, Transfer  # noqa: F401 - likewise

# The face: what the other layers import from here (tests/guards/test_layers.py holds them to it), by module.
__all__, __getattr__, __dir__ = face(__name__, {
    "collective": ("agreed_phase", "CollectiveFailed", "first_line", "from_rank0", "gather", "raise_typed",
                   "RankAgreement"),
    "file_transfer": ("discard", "Part", "Received", "Spooled", "transfer"),
    "liveness": ("Heartbeat", "OpWatch"),
    "read_once": ("Need", "plan_exchange", "round_layout", "SharePlan"),
    "stall": ("DURABLE", "SILENT", "StallClock", "STALLED"),
    "transport": ("PastTheGather", "PeerError", "PeerLink", "PeerLost"),
})
