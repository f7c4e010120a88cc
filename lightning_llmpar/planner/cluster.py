"""The machines a plan is for, and what a precision costs in bytes and FLOP/s."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

__all__ = ["CLUSTERS", "PRECISIONS", "Cluster", "Precision", "cluster_from"]


@dataclass(frozen=True)
class Cluster:
    """Nodes of identical accelerators. Bandwidths are per device and one direction (GB/s); ``peak_tflops`` is
    the dense bf16 peak (fp32 and fp8 peaks follow from it unless given); ``latency_us`` is one collective's
    start-up cost."""

    gpus_per_node: int = 8
    nodes: int = 1
    memory_gb: float = 80.0
    peak_tflops: float = 989.0
    hbm_gbps: float = 3350.0
    intra_node_gbps: float = 450.0
    inter_node_gbps: float = 50.0
    latency_us: float = 10.0
    fp32_tflops: float | None = None
    fp8_tflops: float | None = None
    # The constants below are chosen from public figures, not fitted to any one run (docs/planner.md says how).
    matmul_efficiency: float = 0.75  # the fraction of the bf16 peak large cuBLAS GEMMs reach (8192-cubed)
    fp8_matmul_efficiency: float = 0.65  # the same for fp8 tensorwise-scaled GEMMs (torch._scaled_mm)
    gemm_knee: float = 128.0  # a GEMM dimension of this size runs at half speed (one 128-wide tile); 0: none
    attention_efficiency: float = 0.33  # flash attention 2 on Hopper, forward and backward, causal, head dim 128
    layer_overhead_us: float = 50.0  # launches and Python per layer, microbatch and pass, whatever its size
    comm_overlap: float = 0.9  # the share of compute FSDP's collectives hide behind (NCCL runs beside kernels)
    link_efficiency: float = 0.8  # NCCL's bus bandwidth over the link's rate (nccl-tests on NVLink 4 and 400G IB)
    async_tp_overlap: float = 1.0  # how fully async TP's chunked collectives (all but the first) hide behind matmuls
    elementwise_passes: float = 0.0  # >0: norms/RoPE/activations as this many passes over a layer's input;
    #                                  0: bytes counted op by op, eager or compiled (kernels.py)
    device: str = "cuda"

    def __post_init__(self) -> None:
        for name in ("gpus_per_node", "nodes"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"Cluster: `{name}` must be a positive integer, got {getattr(self, name)!r}.")
        for name in ("memory_gb", "peak_tflops", "hbm_gbps", "intra_node_gbps", "inter_node_gbps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Cluster: `{name}` must be positive, got {getattr(self, name)!r}.")
        for name in ("comm_overlap", "async_tp_overlap"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"Cluster: `{name}` must be in [0, 1], got {getattr(self, name)!r}.")
        for name in ("matmul_efficiency", "fp8_matmul_efficiency", "attention_efficiency", "link_efficiency"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"Cluster: `{name}` must be in (0, 1], got {getattr(self, name)!r}.")

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes

    def tflops(self, precision: Precision) -> float:
        if precision.name == "32-true":
            return self.fp32_tflops or self.peak_tflops / 2  # TF32 tensor cores: half the bf16 rate
        if precision.name == "fp8":
            return self.fp8_tflops or self.peak_tflops * 2
        return self.peak_tflops

    def link_gbps(self, span: int) -> float:
        """Bandwidth of a group whose ranks span ``span`` consecutive devices: NVLink-class inside a node, the
        network once it leaves one."""
        rate = self.intra_node_gbps if span <= self.gpus_per_node else self.inter_node_gbps
        return rate * self.link_efficiency

    @property
    def caching_allocator(self) -> bool:
        """Peaks are the CUDA caching allocator's reserved bytes (what `nvidia-smi` and OOMs see)."""
        return self.device == "cuda"


# Dense peaks from the vendors' data sheets (SXM parts); inter-node: one 400 Gb/s NIC per GPU.
CLUSTERS: dict[str, Cluster] = {
    "h100": Cluster(memory_gb=80, peak_tflops=989, hbm_gbps=3350, intra_node_gbps=450, inter_node_gbps=50),
    "h200": Cluster(memory_gb=141, peak_tflops=989, hbm_gbps=4800, intra_node_gbps=450, inter_node_gbps=50),
    # torchtitan's published H100s (benchmarks/llama3_h100_202412_torchtitan.md): HBM2e SXM parts, 96 GB at
    # 2.4 TB/s, 500 W; their peak "between SXM and NVL": the mean of 989 (SXM) and 835 (NVL) dense bf16.
    # A 500 W cap lowers the clock a dense GEMM sustains: large GEMMs reach less of that peak than at 700 W.
    "h100-hbm2e": Cluster(memory_gb=96, peak_tflops=912, hbm_gbps=2400, intra_node_gbps=450, inter_node_gbps=50,
                          matmul_efficiency=0.65, fp8_matmul_efficiency=0.6),
    "a100": Cluster(memory_gb=80, peak_tflops=312, hbm_gbps=2039, intra_node_gbps=300, inter_node_gbps=25,
                    fp32_tflops=156, fp8_tflops=312),
    # One single-thread process per core of this project's 2-core test machine, gloo between them: the figures
    # `python -m benchmarks.plan_bench --part time` measured. gloo's threads share the compute cores: no overlap.
    "cpu": Cluster(gpus_per_node=2, memory_gb=24, peak_tflops=0.087, hbm_gbps=70, intra_node_gbps=1.1,
                   inter_node_gbps=1.1, latency_us=560, fp32_tflops=0.087, fp8_tflops=0.087, matmul_efficiency=1.0,
                   fp8_matmul_efficiency=1.0, gemm_knee=0.0, attention_efficiency=0.37, layer_overhead_us=270,
                   comm_overlap=0.0, link_efficiency=1.0, elementwise_passes=30.0, device="cpu"),
}


@dataclass(frozen=True)
class Precision:
    """Bytes of what training keeps, per element: compute copies of the parameters, activations, gradient
    reduction; master parameters, gradients and AdamW's two moments stay fp32 in every mode."""

    name: str
    param_bytes: int  # the gathered copies FSDP computes with
    act_bytes: int
    reduce_bytes: int


PRECISIONS: dict[str, Precision] = {
    "32-true": Precision("32-true", 4, 4, 4),
    "bf16-mixed": Precision("bf16-mixed", 2, 2, 4),
    "fp8": Precision("fp8", 2, 2, 4),  # fp8 GEMMs; weights gathered and activations kept in bf16
}


def cluster_from(name: str | Cluster | None = None, **overrides: Any) -> Cluster:
    """A preset by name (``CLUSTERS``), with any field overridden; ``None`` overrides are ignored."""
    base = name if isinstance(name, Cluster) else CLUSTERS.get(name or "h100")
    if base is None:
        raise ValueError(f"Unknown cluster {name!r}; choose one of {sorted(CLUSTERS)} and override its fields.")
    return replace(base, **{k: v for k, v in overrides.items() if v is not None})
