"""Node faults on the soak's own RabbitMQ cluster (``jobrelay chaos --cluster N``).

A node fault names a role in the cluster, not a node, because which node leads the work
queue is only known at run time: ``leader`` stops whichever node leads ``jobrelay.work``
(the case that moves the queue's leadership and every consumer on that node); ``stopped``
starts the node stopped last, which rejoins and catches up; ``other`` stops a running node
that has not been stopped yet, so two different nodes have been lost in one soak. A
majority stays up throughout (the plan never stops two nodes at once on three), so quorum
queues keep accepting and delivering; what is tested is that jobrelay's processes follow.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from jobrelay.chaos.rabbit_cluster import ClusterError, RabbitCluster
from jobrelay.chaos.sandbox import ChaosSetupError
from jobrelay.transport.topology import WORK_QUEUE


@dataclass
class NodeFaults:
    cluster: RabbitCluster
    vhost: str
    stopped: list[int] = field(default_factory=list)  # in the order they were stopped
    ever_stopped: set[int] = field(default_factory=set)

    async def inject(self, kind: str, target: str) -> str:
        """Carry out one node fault; what was done, for the report."""
        try:
            return await asyncio.to_thread(self._inject, kind, target)
        except (ClusterError, ValueError) as exc:
            raise ChaosSetupError(str(exc)) from None

    def _inject(self, kind: str, target: str) -> str:
        if kind == "node_start":
            if not self.stopped:
                raise ValueError("no stopped node to start")
            index = self.stopped.pop()
            self.cluster.start_node(index)
            return f"node {index} started"
        leader = self.cluster.leader_of(WORK_QUEUE, self.vhost)
        if target == "leader":
            index = leader
        else:
            candidates = [
                n.index
                for n in self.cluster.nodes
                if self.cluster.is_up(n.index) and n.index not in self.ever_stopped
            ]
            if not candidates:
                raise ValueError("every node has been stopped once already")
            index = leader if leader in candidates else candidates[0]
        up = sum(1 for n in self.cluster.nodes if self.cluster.is_up(n.index))
        if up - 1 <= len(self.cluster.nodes) // 2:
            raise ValueError(f"stopping node {index} would leave no majority of the cluster")
        self.cluster.stop_node(index)
        self.stopped.append(index)
        self.ever_stopped.add(index)
        role = "the work queue's leader" if index == leader else f"leader was node {leader}"
        return f"node {index} stopped ({role})"
