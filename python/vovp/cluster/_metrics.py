"""A node's numbers in Ray's metrics: each agent reports its store's STATS and its own transfer
counters through ``ray.util.metrics``, tagged with the node, on a timer, so they appear wherever
the Ray cluster's metrics go (Ray's Prometheus endpoint, its dashboard), beside Ray's own.

Names are ``vovp_node_<field>``: the STATS fields of PROTOCOL.md (``used_bytes``,
``objects``...) and the engine's transfer counters as the agent names them (``transfers``,
``transfers_shared``, ``transfers_failed``, ``bytes_received``, ``bytes_sent``,
``streams_served``, ``refused``).
Fields that only grow are Counters (Ray sums what is added: each report adds the growth since
the last one, all of it when the store restarted), the others Gauges. The store's full
exposition stays its own: ``vovp-engine --metrics`` on each node (README.md, "Monitoring").
"""

from __future__ import annotations

import threading
from typing import Callable

from ray.util import metrics

# STATS fields and agent counters that only grow; every other field is a level.
COUNTERS = frozenset({"creates", "evicted_objects", "evicted_bytes", "put_barriers",
                      "transfers", "transfers_shared", "transfers_failed", "bytes_received",
                      "bytes_sent", "streams_served", "refused"})
PREFIX = "vovp_node_"


class NodeReporter:
    """Reports ``read()`` (field -> value) for ``node`` every ``interval`` seconds, on a thread
    of its own, until ``stop()``."""

    def __init__(self, node: str, read: Callable[[], dict[str, int]], interval: float):
        self._node = node
        self._read = read
        self._interval = interval
        self._metrics: dict[str, metrics.Counter | metrics.Gauge] = {}
        self._last: dict[str, int] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="vovp-node-metrics", daemon=True)
        self._thread.start()

    def reported(self) -> dict[str, int]:
        """The values of the last report (empty before the first)."""
        with self._lock:
            return dict(self._last)

    def report(self) -> None:
        """One report now."""
        values = self._read()
        tags = {"node": self._node}
        with self._lock:
            for field, value in values.items():
                metric = self._metrics.get(field)
                if metric is None:
                    kind = metrics.Counter if field in COUNTERS else metrics.Gauge
                    metric = kind(PREFIX + field, description=f"vovp: {field} of the node's "
                                  "store or agent", tag_keys=("node",))
                    self._metrics[field] = metric
                if isinstance(metric, metrics.Counter):
                    last = self._last.get(field, 0)
                    # A count that went down: the store restarted and counts from 0 again.
                    grown = value - last if value >= last else value
                    if grown > 0:
                        metric.inc(grown, tags=tags)
                else:
                    metric.set(value, tags=tags)
                self._last[field] = value

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self.report()
            except Exception:  # noqa: BLE001 - a store gone for a moment must not end reports
                continue
