"""The studies and measurements behind the figures (results in bench/results/). Run each from the
repository root as a module, e.g. `python -m bench.studies.routing_study --help`; each may import
llmserve, common, protos, engine and kernels, never tests/ (tests/test_layers.py)."""
