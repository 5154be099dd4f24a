"""A simulated cluster on one machine: hosts in network namespaces joined by shaped links.

:class:`Cluster` (in :mod:`tools.cluster.cluster`) builds and removes it; the iproute2 calls,
the availability check and the sweep of namespaces left by killed runs are in
:mod:`tools.cluster.netns`. Needs root and iproute2; :func:`unavailable_reason` says why not.
"""
from tools.cluster.cluster import Cluster, tbf_burst
from tools.cluster.netns import ClusterError, parse_rate, sweep_stale, unavailable_reason

__all__ = ["Cluster", "ClusterError", "unavailable_reason", "parse_rate", "sweep_stale",
           "tbf_burst"]
