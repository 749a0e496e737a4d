"""The engine service's settings."""

from __future__ import annotations

from dataclasses import dataclass

DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")
LOAD_FORMATS = ("auto", "dummy")
OPS_BACKENDS = ("auto", "torch", "cuda")


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # HF directory or .gguf; None = the built-in SmolLM2
    device: str = "auto"  # auto = cuda when available
    dtype: str = "auto"  # auto = float32 on CPU, bfloat16 on CUDA
    block_size: int = 16
    num_kv_blocks: int = 0  # 0 = size the pool from kv_cache_gb / free GPU memory
    kv_cache_gb: float = 2.0  # CPU pool size
    gpu_memory_utilization: float = 0.9
    max_model_len: int = 0  # 0 = the model's own context length
    num_threads: int = 0  # torch CPU threads; 0 = torch's default
    seed: int = 0  # for requests without a seed of their own; also seeds dummy weights
    host: str = "0.0.0.0"
    port: int = 50053
    # auto: the checkpoint at `model` (safetensors or GGUF); dummy: seeded random weights for
    # the config.json at `model` (engine/dummy.py)
    load_format: str = "auto"
    # The scheduler's limits, which size the GPU's profiling step and its CUDA graphs.
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enforce_eager: bool = False  # no CUDA graphs for decode steps
    ops_backend: str = "auto"  # layer ops: auto (CUDA kernels when they can run), torch, cuda

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ValueError(f"device={self.device!r} must be one of {DEVICES}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} must be one of {DTYPES}")
        if self.block_size not in (8, 16, 32, 64):
            raise ValueError(f"block_size={self.block_size} must be 8, 16, 32 or 64")
        if self.num_kv_blocks < 0:
            raise ValueError(f"num_kv_blocks={self.num_kv_blocks} must be >= 0")
        if self.kv_cache_gb <= 0:
            raise ValueError(f"kv_cache_gb={self.kv_cache_gb} must be > 0")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]"
            )
        if self.max_model_len < 0:
            raise ValueError(f"max_model_len={self.max_model_len} must be >= 0")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format={self.load_format!r} must be one of {LOAD_FORMATS}")
        if self.ops_backend not in OPS_BACKENDS:
            raise ValueError(f"ops_backend={self.ops_backend!r} must be one of {OPS_BACKENDS}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={self.max_num_seqs} must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= 1")
