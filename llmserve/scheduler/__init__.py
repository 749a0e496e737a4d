"""The CPU scheduler service: queues, iteration-level batching, the paged KV block manager,
preemption and the prefix cache. It owns every request id and every block id. No torch here."""
