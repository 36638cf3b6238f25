"""Utilities every layer may use and that know nothing of checkpoints: fault points, retries and deadlines, the
collector pause, progress logs, argument checks, statistics records."""
