"""`llmserve bench`: replay a workload against a gateway and measure it honestly.

workload.py  seeded request sets of exact token lengths (fixed, random, ShareGPT-like, shared
             prefix, the user's JSONL)
arrivals.py  when each request is sent: all at once, Poisson or gamma at a rate, capped concurrency
backends.py  one streaming request, timed: gRPC (protos/api.proto) or OpenAI HTTP (/v1/completions)
metrics.py   pure functions from per-request timings to the reported statistics
runner.py    drives a backend through a workload on an arrival schedule
report.py    the result document (JSON), the printed tables and the plots
compare.py   two result documents side by side
hf.py        HF transformers' generate, the scripts' baseline (imports torch when called)
cli.py       the `llmserve bench` subcommands

Nothing here imports torch.
"""
