"""Rank to rank: the liveness heartbeat, typed collectives that name the rank that failed, and the one transport
of bytes between ranks (:mod:`.transport`) with what it carries: shared reads (:mod:`.read_once`) and file streams
(:mod:`.file_transfer`)."""

from .read_once import *  # noqa: F401,F403 - the names of the former module dcp_atomic.exchange, for one release
from .transport import PastTheGather, PeerError, PeerLink, PeerLost, Transfer  # noqa: F401 - likewise
