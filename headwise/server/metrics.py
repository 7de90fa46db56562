"""Prometheus metrics in vLLM's naming style (prefix `headwise:`)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
_IO_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1)


class Metrics:
    def __init__(self, model_name: str) -> None:
        self.registry = r = CollectorRegistry()
        lbl = ["model_name"]
        self.model = model_name
        self.running = Gauge("headwise:num_requests_running", "Requests in the running batch", lbl, registry=r)
        self.waiting = Gauge("headwise:num_requests_waiting", "Requests waiting to be scheduled", lbl, registry=r)
        self.kv_usage = Gauge("headwise:kv_cache_usage_perc", "Fraction of a KV pool in use (1 = full)",
                              lbl + ["pool"], registry=r)
        self.kv_bytes = Gauge("headwise:kv_cache_used_bytes", "Bytes of a KV pool in use", lbl + ["pool"], registry=r)
        self.ttft = Histogram("headwise:time_to_first_token_seconds", "Time to first token", lbl,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("headwise:inter_token_latency_seconds", "Time between output tokens", lbl,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("headwise:e2e_request_latency_seconds", "End-to-end request latency", lbl,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.preemptions = Counter("headwise:num_preemptions", "Preempted requests (recomputed later)", lbl, registry=r)
        self.prompt_tokens = Counter("headwise:prompt_tokens", "Prefilled prompt tokens", lbl, registry=r)
        self.generation_tokens = Counter("headwise:generation_tokens", "Generated tokens", lbl, registry=r)
        self.finished = Counter("headwise:request_success", "Finished requests", lbl + ["finished_reason"], registry=r)
        self.prefix_queries = Counter("headwise:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                      lbl, registry=r)
        self.prefix_hits = Counter("headwise:prefix_cache_hits", "Prompt tokens found in the prefix cache",
                                   lbl, registry=r)
        self.cached_bytes = Gauge("headwise:kv_cache_cached_bytes",
                                  "Bytes of cached prefixes no request uses (reclaimable), per KV pool",
                                  lbl + ["pool"], registry=r)
        self._prefix_seen = (0, 0)
        self.kv_format = Gauge("headwise:kv_cache_bytes_per_token", "KV bytes one token takes in one KV head of "
                               "a head class (K and V, scales included), by stored dtype",
                               lbl + ["head_class", "kv_dtype"], registry=r)
        # KV offload directory (disk tier), when the engine has one.
        self.tier_bytes = Gauge("headwise:kv_offload_bytes", "Bytes of cached prefixes in the KV offload directory",
                                lbl, registry=r)
        self.tier_entries = Gauge("headwise:kv_offload_entries", "Entries in the KV offload directory", lbl, registry=r)
        self.tier_hits = Counter("headwise:prefix_cache_disk_hits", "Prompt tokens served from the KV offload "
                                 "tiers (included in prefix_cache_hits)", lbl, registry=r)
        self.tier_served = Counter("headwise:kv_offload_entries_served", "Entries brought back, by tier",
                                   lbl + ["tier"], registry=r)
        self.tier_host_bytes = Gauge("headwise:kv_offload_host_bytes", "Bytes of the host-memory tier", lbl,
                                     registry=r)
        self.tier_errors = Counter("headwise:kv_offload_errors", "Unreadable or damaged entries skipped, failed "
                                   "writes", lbl, registry=r)
        self.tier_read = Histogram("headwise:kv_offload_read_seconds", "Time to read and verify one entry", lbl,
                                   buckets=_IO_BUCKETS, registry=r)
        self.tier_write = Histogram("headwise:kv_offload_write_seconds", "Time to write one entry", lbl,
                                    buckets=_IO_BUCKETS, registry=r)
        self._tier_seen = (0, 0)
        self._served_seen = {"host": 0, "disk": 0}

    def set_kv_format(self, specs) -> None:
        """specs: head class -> the KVClassSpec of the storage it lives in."""
        for head_class, spec in specs.items():
            self.kv_format.labels(self.model, head_class, spec.label).set(spec.bytes_per_head_token)

    def update_state(self, stats, waiting: int) -> None:
        """stats: the engine's EngineStats; waiting: its queue and requests on their way in."""
        m, prefix = self.model, stats.prefix
        self.running.labels(m).set(stats.num_running)
        self.waiting.labels(m).set(waiting)
        for pool, u in stats.usage.items():
            self.kv_usage.labels(m, pool).set(u["usage"])
            self.kv_bytes.labels(m, pool).set(u["used_bytes"])
            self.cached_bytes.labels(m, pool).set(u["cached_bytes"])
        if stats.tier is not None:
            self._update_tier(stats.tier)
        queries, hits = self._prefix_seen
        self.prefix_queries.labels(m).inc(prefix.queries - queries)
        self.prefix_hits.labels(m).inc(prefix.hits - hits)
        self._prefix_seen = (prefix.queries, prefix.hits)

    def _update_tier(self, st) -> None:
        """st: the disk tier's TierStats (cumulative; latencies drained here)."""
        m = self.model
        self.tier_bytes.labels(m).set(st.bytes)
        self.tier_entries.labels(m).set(st.entries)
        self.tier_host_bytes.labels(m).set(st.host_bytes)
        for tier, n in st.served.items():
            self.tier_served.labels(m, tier).inc(n - self._served_seen[tier])
            self._served_seen[tier] = n
        hits, errors = self._tier_seen
        self.tier_hits.labels(m).inc(st.hit_tokens - hits)
        self.tier_errors.labels(m).inc(st.errors - errors)
        self._tier_seen = (st.hit_tokens, st.errors)
        for lst, hist in ((st.read_seconds, self.tier_read), (st.write_seconds, self.tier_write)):
            while lst:
                hist.labels(m).observe(lst.pop())

    def on_finished(self, seq) -> None:
        m = self.model
        self.finished.labels(m, seq.finish_reason or "abort").inc()
        if seq.finish_reason == "abort":
            return
        self.prompt_tokens.labels(m).inc(seq.num_prompt_tokens)
        self.generation_tokens.labels(m).inc(len(seq.output_token_ids))
        if seq.first_token_time is not None:
            self.ttft.labels(m).observe(seq.first_token_time - seq.arrival_time)
        times = seq.token_times
        for a, b in zip(times, times[1:]):
            self.itl.labels(m).observe(b - a)
        if times:
            self.e2e.labels(m).observe(times[-1] - seq.arrival_time)

    def render(self) -> bytes:
        return generate_latest(self.registry)
