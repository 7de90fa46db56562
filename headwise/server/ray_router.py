"""Ray Serve request routers for the HeadwiseEngine deployment (headwise/server/ray_serve.py).

PrefixAffinityRouter sends a prompt to the replica holding its longest prefix (the
bookkeeping is headwise/server/routing.py, plain Python); RoundRobinRouter is the baseline
it is measured against. Both run inside the ingress, in Serve's router.
"""
from __future__ import annotations

from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from headwise.server.routing import PrefixAffinity


def _hashes(pending: PendingRequest | None) -> list[int]:
    # The first argument of `generate` is ray_serve.EngineRequest. Duck-typed: Ray may run
    # the router from a by-value copy of its module, where isinstance against an imported
    # class fails (seen: every request then looked prefix-less).
    req = pending.args[0] if pending is not None and pending.args else None
    return getattr(req, "block_hashes", None) or []


class PrefixAffinityRouter(RequestRouter):
    """Ray Serve request router: the replica holding the prompt's longest prefix, unless it
    has `imbalance` more requests in flight than the least loaded one (then the least
    loaded). Serve falls through to the later ranks when a replica's queue is full."""

    def initialize_state(self, imbalance: int = 4, min_match: float = 0.5) -> None:
        self.affinity = PrefixAffinity(imbalance, min_match)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        ranks = self.affinity.rank(_hashes(pending_request), list(by_id))
        if ranks and pending_request is not None:
            self.affinity.reserve(pending_request.metadata.internal_request_id, ranks[0][0])
        return [[by_id[i] for i in rank] for rank in ranks]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        self.affinity.routed(pending_request.metadata.internal_request_id, replica_id.unique_id,
                             _hashes(pending_request))

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self.affinity.completed(internal_request_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.affinity.forget(replica_id.unique_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        before = set(self.curr_replicas)
        super().update_replicas(replicas)
        for gone in before - set(self.curr_replicas):
            self.affinity.forget(gone.unique_id)


class RoundRobinRouter(RequestRouter):
    """Replicas in turn, whatever the prompt: the baseline routing is measured against."""

    def initialize_state(self) -> None:
        self.turn = 0

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        order = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
        self.turn += 1
        k = self.turn % len(order)
        return [[r] for r in order[k:] + order[:k]]


ROUTERS = {"prefix": PrefixAffinityRouter, "round-robin": RoundRobinRouter}
