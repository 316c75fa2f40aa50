"""The KV memory model's counters, read at scrape time: forks and copy-on-write copies, and the
second KV tier (engine/kv_offload/) under vLLM's names where it has them (its offloading
connector's vllm:kv_offload_*_bytes and vllm:external_prefix_cache_*), ours otherwise."""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

V, P = "vllm:", "pagedserve:"


class KVMemoryCollector:
    """Plain ints the engine thread keeps; a scrape reads them without a lock."""

    def __init__(self, engine, model_name: str) -> None:
        self.engine, self.model_name = engine, model_name

    def _family(self, kind, name: str, doc: str, value: float):
        family = kind(name, doc, labels=["model_name"])
        family.add_metric([self.model_name], value)
        return family

    def collect(self):
        sched = self.engine.scheduler
        c, g = CounterMetricFamily, GaugeMetricFamily
        out = [
            self._family(c, P + "forks", "Requests forked from a sibling (n > 1).",
                         sched.num_forks_total),
            self._family(c, P + "kv_cow_copies", "KV blocks copied on write after a fork.",
                         sched.kv_cache_manager.num_cow_copies_total),
        ]  # fmt: skip
        offload = getattr(self.engine, "kv_offload", None)
        if offload is None:
            return out
        store, tier = offload.store, offload.tier
        out += [
            self._family(c, V + "external_prefix_cache_queries",
                         "Prompt tokens looked up in the KV tier past the pool's hit.",
                         tier.queries_total),
            self._family(c, V + "external_prefix_cache_hits",
                         "Prompt tokens served from the KV tier (loaded, not recomputed).",
                         tier.hit_tokens_total),
            self._family(c, V + "kv_offload_store_bytes", "KV bytes written to the tier.",
                         store.bytes_stored_total),
            self._family(c, V + "kv_offload_load_bytes", "KV bytes read back from the tier.",
                         store.bytes_loaded_total),
            self._family(g, P + "kv_tier_usage_bytes", "Bytes the KV tier holds.",
                         store.usage_bytes),
            self._family(g, P + "kv_tier_capacity_bytes", "The KV tier's bound in bytes.",
                         store.capacity_bytes),
            self._family(g, P + "kv_tier_blocks", "KV blocks in the tier.", len(store)),
            self._family(c, P + "kv_tier_corrupt_files",
                         "Tier files skipped (checksum, truncation, another model).",
                         store.num_corrupt_total),
        ]  # fmt: skip
        swap = getattr(self.engine.scheduler, "kv_swap", None)
        if swap is not None:  # swap preemption (engine/core/kv_swap.py); vLLM V1 has no names
            out += [
                self._family(c, P + "kv_swap_out_blocks",
                             "KV blocks of preempted requests copied to the tier.",
                             swap.out_blocks_total),
                self._family(c, P + "kv_swap_in_blocks",
                             "KV blocks of resumed requests loaded back from the tier.",
                             swap.in_blocks_total),
                self._family(c, P + "kv_swap_preemptions",
                             "Preemptions that swapped the victim out instead of recomputing.",
                             swap.num_swapped_out_total),
                self._family(g, P + "kv_swapped_requests",
                             "Requests swapped out or loading back now.", len(swap.entries)),
            ]  # fmt: skip
        return out
