"""The engine service's settings; `llmserve engine` and `llmserve serve` make their flags from
these fields (common/flags.py)."""

from __future__ import annotations

from dataclasses import dataclass, fields

from llmserve.common.auth import PeerSecurity
from llmserve.common.flags import check_ports, setting

DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")
LOAD_FORMATS = ("auto", "dummy")
ATTENTION_BACKENDS = ("auto", "torch", "cuda")
QUANTIZATIONS = ("auto", "none", "gguf", "int8", "fp8")
KV_CACHE_DTYPES = ("auto", "bf16", "fp16", "fp8")
SPECULATIVE_METHODS = ("none", "ngram", "draft")
ENGINE_ROLES = ("both", "prefill", "decode")
KV_TRANSFER_BACKENDS = ("tcp", "torch")
WILDCARD_HOSTS = ("0.0.0.0", "::")  # a bind on every interface
MAX_SPECULATIVE_TOKENS = 16
# --max-num-batched-tokens 0's budget by device. On a CPU a 512-token prefill step costs what a
# 2048-token one does per token (2-core AVX2 VM, docs/quantization.md "Issue 42, third session"),
# so 16 prompts arriving at once get their first tokens in 4 steps, not after one long one.
GPU_STEP_TOKENS = 2048
CPU_STEP_TOKENS = 512
MAX_SPECULATIVE_NODES = 64  # a token tree's nodes per request and step


@dataclass(frozen=True)
class EngineConfig(PeerSecurity):
    model: str | None = setting(
        None, "HF directory or .gguf file (default: the built-in SmolLM2-135M-Instruct)"
    )
    device: str = setting("auto", "auto = cuda when torch sees a GPU", choices=DEVICES)
    dtype: str = setting("auto", "auto = float32 on CPU, bfloat16 on CUDA", choices=DTYPES)
    block_size: int = setting(16, "tokens per KV block (a power of two <= 256; 1: token-level KV)")
    num_kv_blocks: int = setting(
        0, "KV pool size in blocks (0: from --kv-cache-gb, or free GPU memory)"
    )
    kv_cache_gb: float = setting(
        0.0,
        "CPU KV pool size in GiB (0: room for 16 x --max-num-batched-tokens tokens of this "
        "model, at most a quarter of the memory available at start)",
    )
    kv_offload_gb: float = setting(
        0.0,
        "KV offload: a host-memory tier of this many GiB (per rank; pinned on a GPU) under the "
        "KV pool: blocks the prefix cache evicts are copied down instead of dropped, and a "
        "prefix hit there is copied back (0: off)",
    )
    kv_offload_dir: str | None = setting(
        None,
        "KV offload: a disk tier in a file under this directory (unlinked at once: nothing is "
        "left behind), under the host tier: blocks the host tier evicts go there",
    )
    kv_offload_disk_gb: float = setting(
        0.0, "--kv-offload-dir: the disk tier's size in GiB (0: 4 x --kv-offload-gb)"
    )
    engine_role: str = setting(
        "both",
        "prefill / decode disaggregation (docs/disaggregation.md): prefill = runs prompts and "
        "sends their KV blocks to a decode engine; decode = takes KV transfers on "
        "--kv-transfer-port and decodes; both = colocated",
        choices=ENGINE_ROLES,
    )
    kv_transfer_port: int = setting(
        0, "--engine-role decode: the port KV transfers arrive on, on --host (0: a free one)"
    )
    kv_transfer_backend: str = setting(
        "tcp",
        "prefill / decode: how a KV transfer's payload moves (the control is the authenticated "
        "--kv-transfer-port connection either way; both engines of a pair need the same): tcp = "
        "on that connection, through host memory; torch = torch.distributed send / recv over a "
        "2-rank group per engine pair, NCCL between two GPUs (no host copy), gloo on CPUs (two "
        "engines on one GPU: over TCP, with a warning)",
        choices=KV_TRANSFER_BACKENDS,
    )
    kv_transfer_host: str = setting(
        "",
        "--engine-role decode: the address prefill engines reach --kv-transfer-port at, as this "
        "engine reports it (across machines: this machine's address or DNS name; empty: --host, "
        "or for a wildcard --host, this machine's hostname resolved)",
    )
    quantization: str = setting(
        "auto",
        "weights: gguf = a GGUF's Q4_0 / Q4_1 / Q8_0 / Q4_K blocks kept as stored (CPU); int8 = "
        "weight-only int8 (CPU and GPU); fp8 = float8 e4m3 weights and activations (Hopper / "
        "Ada); none = the model's dtype; auto = gguf on a CPU for a GGUF stored in those blocks "
        "(int8 for Q4_0 / Q4_1 / Q8_0 when tensor-parallel), else none",
        choices=QUANTIZATIONS,
    )
    cpu_dense_weights_mib: int = setting(
        1024,
        "--quantization auto on a CPU with a GGUF's blocks: memory for a second, dense copy of "
        "the decoder layers' weights (oneDNN-packed, float32, or bfloat16 where the CPU has "
        "AVX-512 BF16 / AMX), which steps of --cpu-dense-rows rows or more multiply instead of "
        "the blocks (SmolLM2-135M's: 406 MiB in float32); 0 or a model that does not fit: the "
        "blocks only",
    )
    cpu_dense_rows: int = setting(
        0,
        "from how many rows a step takes the dense copy (0: the crossover measured at start)",
    )
    kv_cache_dtype: str = setting(
        "auto",
        "KV pool element type: auto = the model's dtype; bf16 / fp16 halve a float32 pool; fp8 "
        "(e4m3, scale 1.0) halves a bf16 one",
        choices=KV_CACHE_DTYPES,
    )
    gpu_memory_utilization: float = setting(
        0.9, "fraction of GPU memory for weights, activations and the KV pool"
    )
    max_model_len: int = setting(0, "lower the model's context length (0: the model's own)")
    num_threads: int = setting(
        0,
        "torch CPU threads, per rank of an engine group (0: torch's default; a group's ranks "
        "share the cores)",
    )
    seed: int | None = setting(
        None,
        "sampling seed for unseeded requests (default: a fresh one at each start, so a "
        "restarted server does not repeat itself); also seeds --load-format dummy weights "
        "(default 0)",
    )
    host: str = setting("127.0.0.1", "bind address (0.0.0.0 exposes it)")
    port: int = setting(50053, "gRPC port of the Step stream")
    metrics_port: int = setting(
        9103, "Prometheus /metrics port (0: off)", env="LLMSERVE_METRICS_PORT"
    )
    load_format: str = setting(
        "auto",
        "auto: the checkpoint at --model; dummy: seeded random weights for the config.json at "
        "--model (a directory or the file, e.g. configs/llama-3-8b)",
        choices=LOAD_FORMATS,
    )
    max_num_seqs: int = setting(
        256, "requests per step at most (sizes the memory profile and CUDA graphs)"
    )
    max_num_batched_tokens: int = setting(
        0,
        "tokens per step at most, prefill chunks + decodes (sizes the memory profile); 0: "
        f"{GPU_STEP_TOKENS} on a GPU, {CPU_STEP_TOKENS} on a CPU (a wave of prompts reaches its "
        "first tokens in several shorter steps at the same cost per token)",
    )
    state_snapshot_slots: int = setting(
        0,
        "hybrid linear-attention models: state snapshot slots beside the --max-num-seqs request "
        "slots, from the same memory budget; they keep the state at cached block ends, which "
        "turns the prefix cache on for such a model (0: off, no prefix cache; "
        "docs/architecture.md#state-snapshots)",
    )
    enforce_eager: bool = setting(False, "no CUDA graphs: run decode steps eagerly too")
    attention_backend: str = setting(
        "auto",
        "attention and layer ops: cuda = the CUDA kernels of kernels/; torch = plain torch "
        "(kernels/reference.py), for a card or driver the kernels do not support; auto = the "
        "kernels where they can run (fp16/bf16 on a GPU) and pass a start-up self-check, else "
        "torch, saying why",
        choices=ATTENTION_BACKENDS,
    )
    speculative_method: str = setting(
        "none",
        "speculative decoding: ngram = propose the tokens that followed the latest earlier match "
        "of the last --ngram-max..--ngram-min tokens (prompt lookup); draft = a draft model: "
        "--speculative-model, or without it the model's first --draft-num-layers layers and its "
        "LM head (self-speculation); none = off. Greedy and seeded outputs stay token for token "
        "what they are without it",
        choices=SPECULATIVE_METHODS,
    )
    num_speculative_tokens: int = setting(
        4, "with --speculative-method: tokens proposed per request and step, at most"
    )
    speculative_tree_width: int = setting(
        1,
        "token trees (SpecInfer): propose up to this many branches per request and step, "
        "verified in one forward with a tree attention mask, keeping the longest path the "
        "model agrees with. ngram = the continuations after up to this many distinct earlier "
        "matches; draft = the draft's top tokens at every depth (the best one continues, the "
        "others are leaves). 1 = a chain",
    )
    num_speculative_nodes: int = setting(
        0,
        "with --speculative-tree-width > 1: the tree's nodes (tokens verified) per request and "
        "step, at most; its depth is --num-speculative-tokens (0: width x depth)",
    )
    ngram_max: int = setting(4, "--speculative-method ngram: the longest n-gram matched")
    ngram_min: int = setting(2, "--speculative-method ngram: the shortest n-gram matched")
    draft_num_layers: int = setting(
        0, "--speculative-method draft: the target's first layers run as the draft (0: a third)"
    )
    speculative_model: str | None = setting(
        None,
        "--speculative-method draft: a smaller Llama-family model with the target's vocabulary "
        "(HF directory or .gguf file, read as --model is, --load-format included), run beside "
        "the target on its device in its dtype with a paged KV pool of its own (the KV memory "
        "is shared between the two pools); default: self-speculation (--draft-num-layers)",
    )
    max_loras: int = setting(
        4,
        "LoRA adapters resident on the device at once, so at most this many distinct adapters "
        "in one step (0: no adapters); a projection's table is allocated when an adapter first "
        "adapts it",
    )
    max_lora_rank: int = setting(16, "the highest LoRA rank r accepted (sizes the slot table)")
    max_cpu_loras: int = setting(
        16, "checked adapters kept in host memory (least recently used out), >= --max-loras"
    )

    tensor_parallel_size: int = setting(
        1,
        "engine ranks the model is split across, one per GPU (or CPU worker): attention heads, "
        "MLP and vocabulary sharded, KV pool sharded by KV heads; must divide the KV heads",
    )
    pipeline_parallel_size: int = setting(
        1,
        "stages the layers are split into, one group of --tensor-parallel-size ranks each; the "
        "scheduler keeps this many steps in flight",
    )
    nnodes: int = setting(1, "machines the engine's T x P ranks span (each runs `llmserve engine`)")
    node_rank: int = setting(
        0, "this machine's index among --nnodes; node 0 serves the Step stream"
    )
    master_addr: str = setting(
        "127.0.0.1", "address of node 0, where the ranks meet (torch.distributed rendezvous)"
    )
    master_port: int = setting(
        0, "rendezvous port on node 0 (0: a free port when --nnodes is 1, else 29500)"
    )

    def __post_init__(self) -> None:
        for f in fields(self):
            value, choices = getattr(self, f.name), f.metadata.get("choices")
            if choices is not None and value not in choices:
                raise ValueError(f"{f.name}={value!r} must be one of {choices}")
        if not (1 <= self.block_size <= 256 and self.block_size & (self.block_size - 1) == 0):
            raise ValueError(f"block_size={self.block_size} must be a power of two <= 256")
        for name in (
            "state_snapshot_slots",
            "num_kv_blocks",
            "max_model_len",
            "num_threads",
            "cpu_dense_weights_mib",
            "cpu_dense_rows",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0")
        if self.kv_cache_gb < 0:
            raise ValueError(f"kv_cache_gb={self.kv_cache_gb} must be >= 0")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]"
            )
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={self.max_num_seqs} must be >= 1")
        if self.max_num_batched_tokens < 0:
            tokens = self.max_num_batched_tokens
            raise ValueError(f"max_num_batched_tokens={tokens} must be >= 0 (0: the device's)")
        check_ports(self, "port", "metrics_port", "master_port", "kv_transfer_port")
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "nnodes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank={self.node_rank} must be in [0, nnodes={self.nnodes})")
        self._check_speculation()
        self._check_loras()
        self._check_offload()
        self._check_role()
        if self.world_size % self.nnodes:
            raise ValueError(
                f"tensor_parallel_size x pipeline_parallel_size = {self.world_size} ranks do not "
                f"split evenly over nnodes={self.nnodes}"
            )

    def _check_offload(self) -> None:
        for name in ("kv_offload_gb", "kv_offload_disk_gb"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0")
        if self.kv_offload_dir and not self.kv_offload_gb:
            raise ValueError(
                f"kv_offload_dir={self.kv_offload_dir!r} needs kv_offload_gb > 0: the disk tier "
                "sits under the host tier"
            )
        if self.kv_offload_gb and self.speculative_model:
            raise ValueError(
                "kv_offload_gb needs a single KV pool; the draft model of "
                f"speculative_model={self.speculative_model!r} has a second one"
            )

    def _check_role(self) -> None:
        if self.kv_transfer_host and self.engine_role != "decode":
            raise ValueError(
                f"kv_transfer_host={self.kv_transfer_host!r} is where a decode engine takes KV "
                f"transfers; engine_role={self.engine_role!r} takes none"
            )
        if self.kv_transfer_host in WILDCARD_HOSTS:
            raise ValueError(
                f"kv_transfer_host={self.kv_transfer_host!r} is a bind address, not one a prefill "
                "engine can reach: give this machine's address or name"
            )
        if self.engine_role == "both":
            return
        if self.world_size > 1:
            raise ValueError(
                f"engine_role={self.engine_role!r} is built for one rank; tensor_parallel_size "
                f"x pipeline_parallel_size = {self.world_size}"
            )
        # A decode engine may speculate by n-grams (proposals from the request's own tokens);
        # a draft model's KV would not move with the target's, and a prefill engine samples
        # one token per request.
        allowed = ("none", "ngram") if self.engine_role == "decode" else ("none",)
        if self.speculative_method not in allowed:
            raise ValueError(
                f"speculative_method={self.speculative_method!r} with "
                f"engine_role={self.engine_role!r}: built for "
                + ("'ngram' (a draft model's KV does not move with the target's)"
                   if self.engine_role == "decode" else "none (it samples one token a request)")
            )  # fmt: skip

    @property
    def num_kv_offload_disk_bytes(self) -> int:
        """The disk tier's size in bytes (0 without --kv-offload-dir)."""
        if not self.kv_offload_dir:
            return 0
        return int((self.kv_offload_disk_gb or 4 * self.kv_offload_gb) * (1 << 30))

    @property
    def num_lookahead_slots(self) -> int:
        """KV slots a speculating request needs per step: a chain's tokens or a tree's nodes."""
        if self.speculative_tree_width == 1:
            return self.num_speculative_tokens
        return (
            self.num_speculative_nodes or self.speculative_tree_width * self.num_speculative_tokens
        )

    def _check_tree(self) -> None:
        if not 1 <= self.speculative_tree_width <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"speculative_tree_width={self.speculative_tree_width} must be in "
                f"[1, {MAX_SPECULATIVE_TOKENS}]"
            )
        nodes = self.num_speculative_nodes
        if nodes and self.speculative_tree_width == 1:
            raise ValueError(
                f"num_speculative_nodes={nodes} needs speculative_tree_width > 1 (a chain has "
                f"num_speculative_tokens={self.num_speculative_tokens} nodes)"
            )
        if nodes and not self.num_speculative_tokens <= nodes <= MAX_SPECULATIVE_NODES:
            raise ValueError(
                f"num_speculative_nodes={nodes} must be in [num_speculative_tokens="
                f"{self.num_speculative_tokens}, {MAX_SPECULATIVE_NODES}]"
            )
        if self.num_lookahead_slots > MAX_SPECULATIVE_NODES:
            raise ValueError(
                f"speculative_tree_width x num_speculative_tokens = {self.num_lookahead_slots} "
                f"nodes: at most {MAX_SPECULATIVE_NODES} (set num_speculative_nodes)"
            )

    def _check_speculation(self) -> None:
        if self.speculative_model and self.speculative_method != "draft":
            raise ValueError(
                f"speculative_model={self.speculative_model!r} needs speculative_method='draft', "
                f"not {self.speculative_method!r}"
            )
        if self.speculative_method == "none":
            return
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"num_speculative_tokens={self.num_speculative_tokens} must be in "
                f"[1, {MAX_SPECULATIVE_TOKENS}]"
            )
        self._check_tree()
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(
                f"ngram_min={self.ngram_min} and ngram_max={self.ngram_max} need "
                f"1 <= ngram_min <= ngram_max"
            )
        if self.draft_num_layers < 0:
            raise ValueError(f"draft_num_layers={self.draft_num_layers} must be >= 0")
        if self.speculative_model and self.draft_num_layers:
            raise ValueError(
                f"draft_num_layers={self.draft_num_layers} is for self-speculation; with "
                f"speculative_model={self.speculative_model!r} the draft is that model, whole"
            )
        if self.world_size > 1:
            raise ValueError(
                f"speculative_method={self.speculative_method!r} needs a single-rank engine; "
                f"tensor_parallel_size x pipeline_parallel_size = {self.world_size}"
            )

    def _check_loras(self) -> None:
        if self.max_loras < 0:
            raise ValueError(f"max_loras={self.max_loras} must be >= 0")
        if self.max_loras and not 1 <= self.max_lora_rank <= 512:
            raise ValueError(f"max_lora_rank={self.max_lora_rank} must be in [1, 512]")
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras={self.max_cpu_loras} must be >= max_loras={self.max_loras}"
            )

    @property
    def world_size(self) -> int:
        """Engine ranks in all: tensor_parallel_size x pipeline_parallel_size."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def step_tokens(self, device_type: str) -> int:
        """Tokens per step at most on a device of this type ("cpu", "cuda"):
        --max-num-batched-tokens, or where it is 0 the device's default."""
        if self.max_num_batched_tokens:
            return self.max_num_batched_tokens
        return CPU_STEP_TOKENS if device_type == "cpu" else GPU_STEP_TOKENS

    def features(self) -> list[str]:
        """The engine features these settings use, as common.families.FEATURES names them (a
        model family may refuse some). CUDA graphs count with --device cuda unless
        --enforce-eager."""
        used = {
            "quantization": self.quantization not in ("none", "auto"),
            "tensor_parallel": self.tensor_parallel_size > 1,
            "pipeline_parallel": self.pipeline_parallel_size > 1,
            "speculative_decoding": self.speculative_method != "none",
            "cuda_graphs": self.device.startswith("cuda") and not self.enforce_eager,
        }
        return [name for name, on in used.items() if on]
