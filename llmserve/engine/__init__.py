"""The engine: one process per GPU (or CPU worker). Holds the weights and the paged KV pool, runs
one forward pass per StepPlan, samples, returns tokens. Decides nothing."""
