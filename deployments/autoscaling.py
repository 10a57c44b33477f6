"""Autoscaling Draft and Target replicas by their live sequences.

Serve's default policy counts a replica's ongoing calls. A Draft/Target replica's calls are leases, one per request,
held open until the router cancels them; the cancel then waits for the worker to free the sequence, behind the
model call it is in. So a request's lease and its successor's (admitted as soon as the client has the last token)
overlapped, a steady load of N streams read as more than N, and the autoscaler added a replica it later removed.

Here a replica reports the leases its routers have not ended (`record_autoscaling_stats`: LIVE_SEQUENCES, from
the moment a cancel arrives, not once the release finishes), and the policy asks for the replicas those sequences
need at `target_ongoing_requests` each. The only overlap left is a cancel's way through Serve against the next
grant: a few milliseconds a request, a few percent of the look-back average, so an average up to OVERLAP_ALLOWANCE
of one replica's target above a whole number of replicas is taken as that number. Scale-up and scale-down keep
Serve's delays, bounds and factors (Serve applies them to any policy's answer).
"""

from __future__ import annotations

import math

LIVE_SEQUENCES = "live_sequences"
OVERLAP_ALLOWANCE = 0.25  # of one replica's target_ongoing_requests
POLICY = "deployments.autoscaling:live_sequences_policy"


def replicas_for(live: float, target_per_replica: float) -> int:
    """The replicas `live` sequences need at `target_per_replica` each, overlaps allowed for."""
    return max(0, math.ceil(live / target_per_replica - OVERLAP_ALLOWANCE))


def live_sequences_policy(ctx) -> tuple[int, dict]:
    """A Serve autoscaling policy (ray.serve.config.AutoscalingContext in, desired replicas out): the replicas the
    deployment's live sequences need, averaged over the look-back window. Until every running replica has reported
    them (a replica that just started), Serve's own count of ongoing calls stands in."""
    target = ctx.config.get_target_ongoing_requests()
    reported = (ctx.aggregated_metrics or {}).get(LIVE_SEQUENCES, {})
    if ctx.running_replicas and all(replica in reported for replica in ctx.running_replicas):
        live = sum(reported[replica] for replica in ctx.running_replicas)
    else:
        live = ctx.total_num_requests
    return replicas_for(live, target), {}
