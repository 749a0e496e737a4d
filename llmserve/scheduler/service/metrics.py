"""The scheduler's metrics: each instrument's name, kind, unit and meaning (what
scheduler/service/telemetry.py records and observes; the observed ones read the stats snapshot)."""

from __future__ import annotations

from llmserve.common import telemetry
from llmserve.common.telemetry import Metric

_LAT = telemetry.LATENCY_BUCKETS_S
BANDWIDTH_BUCKETS = tuple(10.0**e for e in range(5, 12))  # 100 kB/s .. 100 GB/s
_COUNTS = telemetry.COUNT_BUCKETS
METRICS = {
    "queue_time": Metric(
        "llmserve.request.queue_time", "histogram", "s",
        "Arrival at the scheduler to first scheduled", _LAT,
    ),
    "prefill_time": Metric(
        "llmserve.request.prefill_time", "histogram", "s",
        "First scheduled to first generated token", _LAT,
    ),
    "step_duration": Metric(
        "llmserve.scheduler.step.duration", "histogram", "s",
        "One iteration: plan, engine round trip, update", telemetry.TOKEN_LATENCY_BUCKETS_S,
    ),
    "batch_size": Metric(
        "llmserve.scheduler.step.batch_size", "histogram", "{request}", "Requests in one step",
        _COUNTS,
    ),
    "step_tokens": Metric(
        "llmserve.scheduler.step.tokens", "histogram", "{token}", "Tokens computed in one step",
        _COUNTS,
    ),
    # Read from the stats snapshot (SchedulerService.stats), the one GetStats returns.
    "num_preemptions": Metric(
        "llmserve.scheduler.preemptions", "observed_counter", "{preemption}",
        "Requests preempted (blocks freed, recomputed later), by reason (memory, priority, fair, "
        "engine_reset)",
    ),
    "num_preemptions_refused": Metric(
        "llmserve.scheduler.preemptions_refused", "observed_counter", "{preemption}",
        "Preemptions not made because every candidate was protected (max_preemptions, grace "
        "steps)",
    ),
    "tenant_virtual_tokens": Metric(
        "llmserve.scheduler.tenant.virtual_tokens", "gauge", "{token}",
        "Each tenant's virtual token counter (weighted service received; fair policy)",
    ),
    "tenant_tokens": Metric(
        "llmserve.scheduler.tenant.tokens", "observed_counter", "{token}",
        "Tokens served per tenant, by kind (prompt: computed prefill; generated)",
    ),
    "finish_reasons": Metric(
        "llmserve.scheduler.requests.finished", "observed_counter", "{request}",
        "Requests that ended, by finish_reason (stop, length, abort)",
    ),
    "num_prompt_tokens": Metric(
        "llmserve.scheduler.prompt_tokens", "observed_counter", "{token}",
        "Prompt tokens of requests admitted (first admission)",
    ),
    "num_generated_tokens": Metric(
        "llmserve.scheduler.generation_tokens", "observed_counter", "{token}", "Tokens generated"
    ),
    "num_prefix_cache_hit_tokens": Metric(
        "llmserve.prefix_cache.hit_tokens", "observed_counter", "{token}",
        "Tokens found in the prefix cache at admission (readmissions after preemption too)",
    ),
    "num_prefix_cache_query_tokens": Metric(
        "llmserve.prefix_cache.query_tokens", "observed_counter", "{token}",
        "Tokens looked up in the prefix cache at admission (readmissions too)",
    ),
    "kv_offload_hit_blocks": Metric(
        "llmserve.kv_offload.hit_blocks", "observed_counter", "{block}",
        "KV offload: blocks a prefix lookup found in a lower tier and brought back, by tier "
        "(host, disk; device hits: llmserve.prefix_cache.hit_tokens)",
    ),
    "kv_offload_blocks_in": Metric(
        "llmserve.kv_offload.blocks_copied", "observed_counter", "{block}",
        "KV offload: blocks copied into each tier (device: brought back; host: evicted from "
        "the device; disk: evicted from the host)",
    ),
    "kv_offload_bytes_in": Metric(
        "llmserve.kv_offload.bytes_copied", "observed_counter", "By",
        "KV offload: bytes copied into each tier (blocks_copied x one block's bytes per rank)",
    ),
    "kv_offload_dropped_blocks": Metric(
        "llmserve.kv_offload.dropped_blocks", "observed_counter", "{block}",
        "KV offload: blocks a tier dropped for room, by tier",
    ),
    "num_swap_ins": Metric(
        "llmserve.kv_offload.swap_ins", "observed_counter", "{request}",
        "KV offload: requests admitted after waiting for their prefix to come back",
    ),
    "swap_in_wait_s": Metric(
        "llmserve.kv_offload.swap_in_wait", "observed_counter", "s",
        "KV offload: seconds requests waited for their prefix to come back, in all",
    ),
    "kv_transfer_duration": Metric(
        "llmserve.kv_transfer.duration", "histogram", "s",
        "Disaggregation: a request's KV transfer, handoff to arrival in the decode pool (done "
        "ones)", _LAT,
    ),
    "kv_transfer_bandwidth": Metric(
        "llmserve.kv_transfer.bandwidth", "histogram", "By/s",
        "Disaggregation: bytes moved / seconds, per KV transfer done (handoff to arrival)",
        BANDWIDTH_BUCKETS,
    ),
    "swap_in_duration": Metric(
        "llmserve.kv_offload.swap_in.duration", "histogram", "s",
        "KV offload: one request's wait for its prefix to come back from a lower tier", _LAT,
    ),
    "num_kv_transfers_by_outcome": Metric(
        "llmserve.kv_transfer.transfers", "observed_counter", "{transfer}",
        "Disaggregation: KV transfers ended, by outcome (done, deadline, dropped, "
        "prefill_lost, decode_lost, cancelled)",
    ),
    "kv_transfer_blocks": Metric(
        "llmserve.kv_transfer.blocks", "observed_counter", "{block}",
        "Disaggregation: KV blocks moved from the prefill to the decode engine",
    ),
    "kv_transfer_bytes": Metric(
        "llmserve.kv_transfer.bytes", "observed_counter", "By",
        "Disaggregation: bytes moved from the prefill to the decode engine",
    ),
    "num_running": Metric(
        "llmserve.scheduler.requests.running", "gauge", "{request}",
        "Requests holding KV blocks and stepping",
    ),
    "num_waiting": Metric(
        "llmserve.scheduler.requests.waiting", "gauge", "{request}",
        "Requests queued (new or preempted)",
    ),
    "kv_usage": Metric(
        "llmserve.kv_cache.usage", "gauge", "1", "Fraction of KV-cache blocks in use by requests"
    ),
    "num_free_blocks": Metric(
        "llmserve.kv_cache.blocks.free", "gauge", "{block}",
        "KV-cache blocks not held by any request",
    ),
    "num_state_slots": Metric(
        "llmserve.state_cache.slots", "gauge", "{slot}",
        "Hybrid linear-attention models: the engine's recurrent-state slots (one per running "
        "request; 0 for a model without state layers)",
    ),
    "num_free_state_slots": Metric(
        "llmserve.state_cache.slots.free", "gauge", "{slot}",
        "Hybrid linear-attention models: recurrent-state slots no running request holds",
    ),
    "num_state_snapshot_slots": Metric(
        "llmserve.state_cache.snapshot_slots", "gauge", "{slot}",
        "Hybrid models' prefix cache: the engine's state snapshot slots (--state-snapshot-slots)",
    ),
    "num_used_state_snapshot_slots": Metric(
        "llmserve.state_cache.snapshot_slots.used", "gauge", "{slot}",
        "Hybrid models' prefix cache: snapshot slots holding a cached block's state",
    ),
    "kv_bytes_per_token": Metric(
        "llmserve.kv_cache.token_size", "gauge", "By",
        "KV-cache bytes one token takes over all layers (the engine's pool layout: per-head K "
        "and V, or multi-head latent attention's one latent)",
    ),
    "throughput": Metric(
        "llmserve.scheduler.generation_throughput", "gauge", "{token}/s",
        "Tokens generated per second since the previous reading (at most 10 s back)",
    ),
    "num_spec_rows": Metric(
        "llmserve.spec_decode.verifications", "observed_counter", "{verification}",
        "Speculative decoding: request steps that verified proposed tokens",
    ),
    "num_spec_draft_tokens_per_pos": Metric(
        "llmserve.spec_decode.draft_tokens", "observed_counter", "{token}",
        "Speculative decoding: tokens proposed, by position in the proposal (0 first)",
    ),
    "num_spec_accepted_tokens_per_pos": Metric(
        "llmserve.spec_decode.accepted_tokens", "observed_counter", "{token}",
        "Speculative decoding: proposed tokens accepted, by position in the proposal (0 first)",
    ),
    "spec_acceptance_rate": Metric(
        "llmserve.spec_decode.acceptance_rate", "gauge", "1",
        "Speculative decoding: accepted / proposed tokens since start",
    ),
    "spec_mean_accepted_length": Metric(
        "llmserve.spec_decode.mean_accepted_length", "gauge", "{token}",
        "Speculative decoding: tokens per verification since start (accepted + the one sampled)",
    ),
}  # fmt: skip
