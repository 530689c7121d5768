"""Devices and clusters as data: what a step's time is made of on a given machine.

A `Device` is one accelerator (peak FLOP/s per dtype, memory, memory bandwidth, and the share of its
peak that real kernels reach); a `Cluster` is nodes of such devices (how many per node, the bandwidth
between two of them inside a node and across nodes, the host link, the CPU that runs offloaded Adam).
Every number carries its source: a vendor datasheet, a measurement in this repository's results, or an
assumption said as one, which a cluster file overrides. `load_cluster` reads a user's own cluster from
YAML (a built-in device by name, or a whole device, and any field of the cluster).

Bandwidths are bytes per second in one direction, per device: what one device can send while it also
receives (NVLink's and InfiniBand's "bidirectional" figures are twice this).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from llmtrain.errors import ConfigError
from llmtrain.units import parse_bytes

GiB = 1 << 30
DATASHEET_A100 = "NVIDIA A100 Tensor Core GPU datasheet (SXM4)"
DATASHEET_H100 = "NVIDIA H100 Tensor Core GPU datasheet (SXM5)"
DATASHEET_H200 = "NVIDIA H200 Tensor Core GPU datasheet (SXM)"
# The achieved shares of peak are assumptions, each one checked: tests/test_planning_time.py holds the
# predictions against torchtitan's published runs and this repository's measured H200 run.
ASSUMED_MATMUL = "assumed: the share of peak cuBLAS sustains on large bf16 GEMMs; a cluster file can set it"
ASSUMED_ATTENTION = "assumed: the share of peak fused (flash) attention sustains forward and backward"
ASSUMED_LINK = "assumed: NCCL's bus bandwidth is about 80% of the link's"


# Dense (no 2:4 sparsity) BF16 tensor-core peak FLOP/s per device, from the vendors' datasheets.
# Matched in order as case-insensitive substrings of the CUDA device name, so specific names come
# first. None marks devices whose peak is not known well enough to report an MFU.
PEAK_BF16_FLOPS: tuple[tuple[str, float | None], ...] = (
    ("GH200", 989e12),
    ("H200 NVL", 835e12),
    ("H200", 989e12),  # H200 SXM
    ("H100 NVL", 835e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),  # H100 SXM5 ("NVIDIA H100 80GB HBM3")
    ("H800", 989e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("L4", 121e12),
    ("A10G", None),  # AWS's A10 variant runs at lower clocks; no published tensor peak
    ("A10", 125e12),
    ("A40", 150e12),
    ("MI300X", 1307e12),
    ("MI250X", 383e12),
)


def peak_flops_for_name(device_name: str) -> float | None:
    """Peak dense BF16 FLOP/s of one device with this (CUDA) name; None when unknown."""
    lowered = device_name.lower()
    for fragment, peak in PEAK_BF16_FLOPS:
        if fragment.lower() in lowered:
            return peak
    return None


@dataclass(frozen=True)
class Device:
    """One accelerator. `matmul_efficiency` is the share of peak a large matmul reaches; a matmul whose
    smallest dimension is `matmul_half_dim` reaches half of that (smaller ones starve the device)."""

    name: str
    peak_flops: dict[str, float]  # precision ("bf16", "fp32") -> dense FLOP/s
    memory_bytes: int
    memory_bandwidth: float  # bytes/s
    matmul_efficiency: float = 0.8
    matmul_half_dim: int = 512
    matmul_overhead_s: float = 0.0  # fixed seconds per product (dispatch, launch): what small ones pay
    attention_efficiency: float = 0.5
    sources: dict[str, str] = field(default_factory=dict)

    def peak(self, precision: str) -> float:
        try:
            return self.peak_flops[precision]
        except KeyError:
            raise ConfigError(
                f"--precision: {self.name} has no peak FLOP/s for {precision}; "
                f"it has {', '.join(sorted(self.peak_flops))}"
            ) from None


@dataclass(frozen=True)
class Cluster:
    """Nodes of one device kind. `nodes` is how many the plan may use."""

    device: Device
    devices_per_node: int
    nodes: int = 1
    intra_node_bandwidth: float = 0.0  # bytes/s per device, one direction (NVLink)
    inter_node_bandwidth: float = 0.0  # bytes/s per device, one direction (its NIC's share)
    host_bandwidth: float = 0.0  # bytes/s per device, host <-> device (PCIe), one direction
    link_efficiency: float = 0.8  # share of a link's bandwidth a collective reaches
    intra_node_latency: float = 10e-6  # seconds per step of a ring inside a node
    inter_node_latency: float = 20e-6  # seconds per step of a ring across nodes
    cpu_adam_rate: float = 2e9  # parameters per second one node's CPU Adam updates (all its cores)
    nvme_bandwidth: float = 6e9  # bytes/s one node reads or writes its NVMe swap
    # The CPU cores a node's devices share, where they are processes on one host's cores (a calibrated
    # CPU); 0 where each device computes on its own (a GPU).
    host_cores: int = 0
    # Where they do, the share of a waiting process's core that the processes at work take up (0: none,
    # 1: all of it): the scheduler hands a core on when its process sleeps in a collective, unless the
    # cores are two hyperthreads of one, where a thread running alone gains less. Measured by plan
    # --calibrate; all of it where not measured.
    core_handoff: float = 1.0
    # Seconds per parameter of a rank that each engine kind (timing.engine_kind) spends beyond the
    # modelled terms, per step and per micro-batch: hooks, bucket copies, flattening. Measured by
    # plan --calibrate; none where not measured (the built-in GPUs: there it hides under the kernels).
    engine_overhead: dict[str, dict[str, float]] = field(default_factory=dict)
    # What engine_overhead was derived from: each kind's real engine step (seconds, the slowest rank's)
    # at 1 and 2 micro-batches, so a later time model derives it again (calibrate.engine_overhead).
    engine_steps: dict[str, dict[int, float]] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        return self.devices_per_node * self.nodes

    @property
    def shares_cores(self) -> bool:
        """Whether a node's devices are more processes than its cores: then one that waits hands its
        core to another, and a collective's copies compete with the compute for the same cores."""
        return 0 < self.host_cores < self.devices_per_node

    def with_size(self, devices_per_node: int | None = None, nodes: int | None = None) -> Cluster:
        return replace(
            self,
            devices_per_node=devices_per_node or self.devices_per_node,
            nodes=nodes or self.nodes,
        )


def _bf16_peak(name: str) -> float:
    """A built-in GPU's dense bf16 peak, from the one table of them."""
    peak = peak_flops_for_name(name)
    if peak is None:
        raise ValueError(f"no bf16 peak for {name!r} in PEAK_BF16_FLOPS")
    return peak


def _gpu(
    name: str,
    peaks: tuple[float, float],
    memory: int,
    bandwidth: float,
    shares: tuple[float, float],
    datasheet: str,
    memory_source: str,
) -> Device:
    """A GPU from its datasheet: (bf16, fp32) peaks, and the (matmul, attention) shares of peak reached."""
    return Device(
        name,
        {"bf16": peaks[0], "fp32": peaks[1]},
        memory,
        bandwidth,
        matmul_efficiency=shares[0],
        attention_efficiency=shares[1],
        sources={
            "peak_flops": f"{datasheet}: dense bf16 tensor core and fp32 (torch keeps TF32 off for matmuls)",
            "memory_bytes": memory_source,
            "memory_bandwidth": datasheet,
            "matmul_efficiency": ASSUMED_MATMUL,
            "attention_efficiency": ASSUMED_ATTENTION,
        },
    )


# A100: cuBLAS sustains about 80% of its 312 TFLOP/s, FlashAttention-2 about half. H100/H200: their
# 989 TFLOP/s assume boost clocks that large GEMMs do not hold (about 65% sustained); attention reaches
# less of it (about 40%).
_A100_SHARES, _H100_SHARES = (0.8, 0.5), (0.65, 0.4)
_NVIDIA_SMI = "GiB as nvidia-smi counts them"

DEVICES: dict[str, Device] = {
    "a100-40gb": _gpu(
        "A100 40GB",
        (_bf16_peak("A100"), 19.5e12),
        40 * GiB,
        1555e9,
        _A100_SHARES,
        DATASHEET_A100,
        _NVIDIA_SMI,
    ),
    "a100-80gb": _gpu(
        "A100 80GB",
        (_bf16_peak("A100"), 19.5e12),
        80 * GiB,
        2039e9,
        _A100_SHARES,
        DATASHEET_A100,
        _NVIDIA_SMI,
    ),
    "h100": _gpu(
        "H100 SXM",
        (_bf16_peak("H100 SXM"), 67e12),
        80 * GiB,
        3350e9,
        _H100_SHARES,
        DATASHEET_H100,
        _NVIDIA_SMI,
    ),
    "h200": _gpu(
        "H200 SXM",
        (_bf16_peak("H200 SXM"), 67e12),
        150_109_880_320,
        4800e9,
        _H100_SHARES,
        DATASHEET_H200,
        "torch.cuda's total memory on an H200, bench/results/gpu.json",
    ),
}

_NVLINK_A100 = "A100 datasheet: third-generation NVLink, 600 GB/s per GPU both ways"
_NVLINK_H100 = "H100/H200 datasheets: fourth-generation NVLink, 900 GB/s per GPU both ways"
_HDR = "NVIDIA DGX A100 user guide: one 200 Gb/s HDR InfiniBand adapter per GPU"
_NDR = "NVIDIA DGX H100/H200 user guide: one 400 Gb/s NDR InfiniBand adapter (ConnectX-7) per GPU"
_ASSUMED_HOST = "assumed: DeepSpeed ZeRO-Offload's CPU Adam on a node's two server CPUs; set cpu_adam_rate"


def _dgx(device: str, nvlink: float, nvlink_source: str, nic: float, nic_source: str, pcie: float) -> Cluster:
    return Cluster(
        DEVICES[device],
        devices_per_node=8,
        intra_node_bandwidth=nvlink,
        inter_node_bandwidth=nic,
        host_bandwidth=pcie,
        sources={
            "devices_per_node": "an 8-GPU HGX/DGX node",
            "intra_node_bandwidth": nvlink_source,
            "inter_node_bandwidth": nic_source,
            "host_bandwidth": f"PCIe Gen{4 if pcie < 40e9 else 5} x16, one direction",
            "link_efficiency": ASSUMED_LINK,
            "cpu_adam_rate": _ASSUMED_HOST,
            "nvme_bandwidth": "assumed: a node's local NVMe RAID, about 6 GB/s",
        },
    )


CLUSTERS: dict[str, Cluster] = {
    "a100-40gb": _dgx("a100-40gb", 300e9, _NVLINK_A100, 25e9, _HDR, 32e9),
    "a100-80gb": _dgx("a100-80gb", 300e9, _NVLINK_A100, 25e9, _HDR, 32e9),
    "h100": _dgx("h100", 450e9, _NVLINK_H100, 50e9, _NDR, 64e9),
    "h200": _dgx("h200", 450e9, _NVLINK_H100, 50e9, _NDR, 64e9),
}


def builtin_cluster(name: str) -> Cluster:
    """The built-in cluster of this device name (`h100`, `a100-80gb`, ...)."""
    key = name.lower()
    if key not in CLUSTERS:
        raise ConfigError(
            f"--gpu: no built-in device {name!r}; choose one of {', '.join(CLUSTERS)} or give --cluster FILE"
        )
    return CLUSTERS[key]


_DEVICE_FIELDS = {f.name for f in fields(Device)} - {"sources"}
_CLUSTER_FIELDS = {f.name for f in fields(Cluster)} - {"device", "sources"}
ENGINE_KINDS = ("zero1", "zero3", "fsdp2", "tp")
# What a cluster without a base must say: the links every step's time depends on.
_OWN_CLUSTER_FIELDS = ("devices_per_node", "intra_node_bandwidth", "inter_node_bandwidth", "host_bandwidth")


def load_cluster(path: Path) -> Cluster:
    """A cluster from a YAML file: `device:` a built-in name or a mapping of Device's fields, then any of
    Cluster's fields (`base:` a built-in cluster to start from). A field read from the file has the file
    as its source. Errors name the file and the field, in one line."""
    import yaml

    try:
        data = yaml.safe_load(path.read_text())
    except OSError as err:
        raise ConfigError(f"--cluster {path}: cannot read it ({err.strerror}); give a YAML file") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"--cluster {path}: not YAML ({str(err).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"--cluster {path}: must be a mapping of cluster fields (base: h100, nodes: 4, ...)"
        )
    return cluster_from_dict(data, f"--cluster {path}")


def cluster_from_dict(data: dict[str, Any], where: str) -> Cluster:
    base_name = data.pop("base", None)
    unknown = set(data) - _CLUSTER_FIELDS - {"device"}
    if unknown:
        raise ConfigError(
            f"{where}: unknown field {sorted(unknown)[0]!r}; fields: device, base, {', '.join(sorted(_CLUSTER_FIELDS))}"
        )
    base = builtin_cluster(str(base_name)) if base_name is not None else None
    device = _device_from(data.pop("device", None), base, where)
    overhead, steps = data.pop("engine_overhead", None), data.pop("engine_steps", None)
    values: dict[str, Any] = {key: _number(where, key, value) for key, value in data.items()}
    if values.get("core_handoff", 0) > 1:
        raise ConfigError(
            f"{where}: core_handoff is a share of a core, 0 to 1, got {values['core_handoff']!r}"
        )
    if overhead is not None:
        values["engine_overhead"] = _engine_overhead(overhead, where)
    if steps is not None:
        values["engine_steps"] = _engine_steps(steps, where)
    sources = {**(base.sources if base else {}), **{key: where for key in values}}
    if base is not None:
        return replace(base, device=device, sources=sources, **values)
    missing = [key for key in _OWN_CLUSTER_FIELDS if key not in values]
    if missing:
        raise ConfigError(f"{where}: give {', '.join(missing)} (or base: one of {', '.join(CLUSTERS)})")
    return Cluster(device=device, sources=sources, **values)


def _engine_overhead(spec: Any, where: str) -> dict[str, dict[str, float]]:
    if not isinstance(spec, dict) or not set(spec) <= set(ENGINE_KINDS):
        raise ConfigError(
            f"{where}: engine_overhead maps an engine kind ({', '.join(ENGINE_KINDS)}) to per_step and per_micro_batch"
        )
    out = {}
    for kind, each in spec.items():
        if not isinstance(each, dict) or set(each) != {"per_step", "per_micro_batch"}:
            raise ConfigError(
                f"{where}: engine_overhead.{kind} must give per_step and per_micro_batch (seconds per parameter)"
            )
        out[kind] = {
            key: float(_number(where, f"engine_overhead.{kind}.{key}", value)) for key, value in each.items()
        }
    return out


def _engine_steps(spec: Any, where: str) -> dict[str, dict[int, float]]:
    if not isinstance(spec, dict) or not set(spec) <= set(ENGINE_KINDS):
        raise ConfigError(
            f"{where}: engine_steps maps an engine kind ({', '.join(ENGINE_KINDS)}) to 1: and 2: seconds"
        )
    out = {}
    for kind, each in spec.items():
        if not isinstance(each, dict) or set(each) != {1, 2}:
            raise ConfigError(
                f"{where}: engine_steps.{kind} must give 1: and 2: (seconds of a step at 1 and 2 micro-batches)"
            )
        out[kind] = {m: float(_number(where, f"engine_steps.{kind}.{m}", value)) for m, value in each.items()}
    return out


def _device_from(spec: Any, base: Cluster | None, where: str) -> Device:
    if spec is None:
        if base is None:
            raise ConfigError(f"{where}: give device: (one of {', '.join(DEVICES)}, or its fields)")
        return base.device
    if isinstance(spec, str):
        if spec.lower() not in DEVICES:
            raise ConfigError(f"{where}: device: no built-in {spec!r}; choose one of {', '.join(DEVICES)}")
        return DEVICES[spec.lower()]
    if not isinstance(spec, dict):
        raise ConfigError(f"{where}: device: a built-in name or a mapping of its fields")
    spec = dict(spec)
    unknown = set(spec) - _DEVICE_FIELDS
    if unknown:
        raise ConfigError(
            f"{where}: device: unknown field {sorted(unknown)[0]!r}; fields: {', '.join(sorted(_DEVICE_FIELDS))}"
        )
    missing = {"name", "peak_flops", "memory_bytes", "memory_bandwidth"} - set(spec)
    if missing:
        raise ConfigError(f"{where}: device: missing {', '.join(sorted(missing))}")
    peaks = spec.pop("peak_flops")
    if not isinstance(peaks, dict) or not peaks:
        raise ConfigError(f"{where}: device: peak_flops maps a precision (bf16, fp32) to FLOP/s")
    values = {key: _number(where, f"device.{key}", value) for key, value in spec.items() if key != "name"}
    return Device(
        name=str(spec["name"]),
        peak_flops={str(k): _number(where, f"device.peak_flops.{k}", v) for k, v in peaks.items()},
        sources={key: where for key in (*values, "peak_flops")},
        **values,
    )


_WHOLE_NUMBERS = ("devices_per_node", "nodes", "matmul_half_dim", "host_cores")
_MAY_BE_ZERO = (
    "matmul_overhead_s",
    "intra_node_latency",
    "inter_node_latency",
    "per_step",
    "per_micro_batch",
    "core_handoff",
)


def _number(where: str, key: str, value: Any) -> Any:
    """A positive number as YAML gives it (`25e9` is a string to YAML 1.1), memory_bytes also as a size
    (`80GiB`)."""
    name = key.rsplit(".", 1)[-1]
    try:
        if isinstance(value, bool):
            raise ValueError(value)
        number = parse_bytes(value) if name == "memory_bytes" else float(value)
    except (TypeError, ValueError):
        number = -1
    if number < 0 or (number == 0 and name not in _MAY_BE_ZERO):
        raise ConfigError(f"{where}: {key} must be a positive number, got {value!r}")
    return int(number) if name in (*_WHOLE_NUMBERS, "memory_bytes") else number
