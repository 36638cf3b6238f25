"""Rank to rank: the liveness heartbeat, typed collectives that name the rank that failed, and the exchange of
verified bytes between ranks (read once)."""

from .read_once import *  # noqa: F401,F403 - the names of the former module dcp_atomic.exchange, for one release
