"""What the daemon is doing, for `ckptfs status`, systemd's STATUS= line and Prometheus.

`Stats.refresh()` runs on the trio thread (every second, and for each status request) and
replaces one immutable snapshot; the Prometheus HTTP server thread only reads the latest
snapshot, so it never touches live state. prometheus_client does the text exposition and
the HTTP serving (content negotiation, escaping, histogram format).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Iterator
from typing import Any


from ckptfs.config import human_size as _human
from ckptfs.config import parse_addr
from ckptfs.errors import MountError
from ckptfs.uploader import LATENCY_BUCKETS

_RATE_WINDOW = 10.0


class Stats:
    def __init__(self, extra: dict[str, Any], components: list[Any], *,
                 draining: Callable[[], bool],
                 pending: Callable[[], list[tuple[str, int, str | None]]]) -> None:
        self.extra = extra  # fixed facts: pid, mount point, source, recovery report
        self.components = components  # each has stats(): a dict of its own counters
        self._draining = draining
        self._pending = pending
        self.spot_notice: dict | None = None
        self._samples: collections.deque[tuple[float, int]] = collections.deque()
        self.snapshot: dict[str, Any] = {}
        self.refresh()

    def refresh(self) -> dict[str, Any]:
        counters: dict[str, Any] = {}
        for component in self.components:
            counters.update(component.stats())
        now = time.monotonic()
        uploaded = counters.get("bytes_uploaded", 0)
        self._samples.append((now, uploaded))
        while len(self._samples) > 1 and now - self._samples[0][0] > _RATE_WINDOW:
            self._samples.popleft()
        t0, b0 = self._samples[0]
        rate = (uploaded - b0) / (now - t0) if now > t0 else 0.0
        pending = [{"path": p, "size": size, "error": err} for p, size, err in self._pending()]
        self.snapshot = {
            **self.extra, **counters,
            "draining": self._draining(), "spot_notice": self.spot_notice,
            "pending": pending, "pending_files": len(pending),
            "pending_bytes": sum(p["size"] for p in pending),
            "failed": [p for p in pending if p["error"]],
            "upload_throughput_bytes_per_second": round(rate),
        }
        return self.snapshot

    def line(self) -> str:
        """One line for systemd's STATUS=."""
        s = self.snapshot
        text = (f"{s['pending_files']} uploads pending ({_human(s['pending_bytes'])}), "
                f"{s['uploads_in_flight']} in flight, {s['uploads_done']} done")
        if s["failed"]:
            text += f", {len(s['failed'])} failing"
        if s.get("s3_down_since"):
            text = f"S3 not answering for {s['s3_down_seconds']:.0f}s; " + text
        if s["draining"]:
            text = "draining: " + text
        if s["spot_notice"]:
            text += "; spot interruption notice received"
        return text


class _Collector:
    """prometheus_client's collector protocol (collect); imported only with --metrics-addr."""

    def __init__(self, stats: Stats) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                            HistogramMetricFamily)

        s = self.stats.snapshot

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(f"ckptfs_{name}", doc, value=value)

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"ckptfs_{name}", doc, value=value)

        yield counter("uploaded_bytes", "Bytes S3 accepted in parts and PUTs", s["bytes_uploaded"])
        yield counter("downloaded_bytes", "Bytes fetched from S3 for reads", s["bytes_downloaded"])
        yield counter("local_read_bytes", "Bytes read from staged files and local copies",
                      s["local_read_bytes"])
        yield counter("written_bytes", "Bytes written to staged files, through the daemon or "
                      "(as the files grew) by the kernel itself", s["bytes_written"]
                      + s.get("bytes_written_passthrough", 0))
        yield from _passthrough(s, counter, gauge)
        yield counter("uploads", "Files made durable in S3", s["uploads_done"])
        yield counter("upload_failures", "Uploads that failed after retries", s["upload_failures"])
        yield counter("parts_uploaded", "Multipart parts uploaded", s["parts_sent"])
        yield counter("retries", "S3 requests of uploads retried after transient faults", s["retries"])
        yield counter("cache_hits", "Read chunks served from the in-memory chunk cache",
                      s["chunk_cache_hits"])
        yield counter("cache_misses", "Read chunks fetched from S3", s["chunk_cache_misses"])
        yield counter("disk_cache_hits", "Reads answered from the read cache on disk",
                      s["chunk_disk_hits"])
        requests = CounterMetricFamily("ckptfs_fuse_requests",
                                       "Requests the kernel sent the daemon, by operation", labels=["op"])
        for op, n in sorted(s["fuse_requests"].items()):
            requests.add_metric([op], n)
        yield requests
        yield gauge("pending_uploads", "Closed files not yet in S3", s["pending_files"])
        yield gauge("pending_bytes", "Bytes of closed files not yet in S3", s["pending_bytes"])
        yield gauge("uploads_in_flight", "Uploads and streamed parts in flight", s["uploads_in_flight"])
        yield gauge("cache_bytes", "Bytes in the on-disk read cache (clean copies and chunks)",
                    s["cache_bytes"])
        yield gauge("s3_unanswered_seconds", "Seconds since S3 last answered, during an outage "
                    "(0 while it answers)", s.get("s3_down_seconds", 0.0))
        yield counter("s3_outages", "Times S3 stopped answering", s.get("s3_outages", 0))
        yield counter("stale_answers", "Async-mode lookups answered from what the mount knows "
                      "while S3 owed an answer", s.get("stale_answers", 0))
        yield gauge("draining", "1 while the mount drains before unmounting", int(s["draining"]))
        yield gauge("spot_interruption_notice", "1 once a spot interruption notice arrived",
                    int(bool(s["spot_notice"])))
        buckets, total = [], 0
        for bound, count in zip([*map(str, LATENCY_BUCKETS), "+Inf"], s["latency_counts"]):
            total += count
            buckets.append((bound, total))
        yield HistogramMetricFamily("ckptfs_upload_duration_seconds",
                                    "Time from close/fsync to the object complete and verified in S3",
                                    buckets=buckets, sum_value=s["latency_sum"])


def _passthrough(s: dict[str, Any], counter: Callable[[str, str, float], Any],
                 gauge: Callable[[str, str, float], Any]) -> Iterator[Any]:
    """Which path opens took, and the bytes each served."""
    from prometheus_client.core import CounterMetricFamily

    yield gauge("passthrough", "1 if the kernel reads and writes local files itself",
                int(s.get("passthrough", False)))
    yield counter("passthrough_opens", "Opens the kernel serves from a local file itself",
                  s.get("passthrough_opens", 0))
    yield counter("passthrough_fallbacks", "Opens of local files the daemon had to serve",
                  s.get("passthrough_fallbacks", 0))
    opens = CounterMetricFamily("ckptfs_opens", "File opens, by the path that serves the "
                                "handle's reads", labels=["path"])
    for path in ("passthrough_staged", "passthrough_cached", "daemon"):
        opens.add_metric([path], s.get(f"opens_{path}", 0))
    yield opens
    yield counter("daemon_read_bytes", "Bytes the daemon replied to reads",
                  s.get("bytes_read_daemon", 0))
    yield counter("passthrough_opened_bytes", "Sizes of the files read opens passed through "
                  "(the kernel reads them itself, unseen)", s.get("bytes_opened_passthrough", 0))


def serve(addr: str, stats: Stats) -> Any:
    """Serve /metrics on `addr` from a background thread; returns the server (for shutdown)."""
    from prometheus_client import start_http_server
    from prometheus_client.registry import CollectorRegistry

    host, port = parse_addr(addr)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(stats))
    try:
        server, _thread = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        raise MountError(f"cannot serve metrics on {addr}: {exc.strerror or exc}") from None
    return server
