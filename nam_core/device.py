"""What the machine offers: the only module in nam that asks CUDA anything.

``DeviceInfo.probe()`` reads the real device once. ``DeviceInfo.profile(name)`` returns a named fake used by
tests and by ``--device-profile``: requirements are evaluated against a fake exactly as against a real
device, but checks that must launch code are reported as skipped (``is_fake``).

There is deliberately no table mapping GPU names to limits: the probe reads the limits the driver reports.
The fake profiles carry the numbers the driver reported on those parts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from nam_core.errors import NamError


@dataclass(frozen=True)
class DeviceInfo:
    kind: str
    """"cpu" or "cuda"."""
    name: str
    """Device name as the driver reports it, or "cpu"."""
    capability: tuple[int, int] | None = None
    """CUDA compute capability (major, minor); None on CPU."""
    smem_per_block_optin: int | None = None
    """Opt-in shared memory per block, bytes (what a kernel may request); None on CPU."""
    sm_count: int | None = None
    memory_bytes: int | None = None
    """Total device memory, bytes."""
    device_count: int = 0
    """CUDA devices visible to this process."""
    torch_version: str = ""
    cuda_version: str | None = None
    profile_name: str | None = None
    """Name of the fake profile this came from; None when probed from the real machine."""

    @property
    def is_fake(self) -> bool:
        return self.profile_name is not None

    @property
    def is_cuda(self) -> bool:
        return self.kind == "cuda"

    @property
    def label(self) -> str:
        cap = f" sm_{self.capability[0]}{self.capability[1]}" if self.capability else ""
        fake = f" (profile {self.profile_name})" if self.is_fake else ""
        return f"{self.name}{cap}{fake}"

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["is_fake"] = self.is_fake
        return d

    @classmethod
    def probe(cls, index: int = 0) -> "DeviceInfo":
        """Read the real device: CUDA device ``index`` when CUDA is available, else the CPU."""
        import torch

        if not torch.cuda.is_available():
            return cls(kind="cpu", name="cpu", torch_version=torch.__version__)
        props = torch.cuda.get_device_properties(index)
        return cls(
            kind="cuda",
            name=props.name,
            capability=(props.major, props.minor),
            # None if this torch build cannot tell: requirements on it then fail, they never guess.
            smem_per_block_optin=getattr(props, "shared_memory_per_block_optin", None),
            sm_count=props.multi_processor_count,
            memory_bytes=props.total_memory,
            device_count=torch.cuda.device_count(),
            torch_version=torch.__version__,
            cuda_version=torch.version.cuda,
        )

    @classmethod
    def profile(cls, name: str) -> "DeviceInfo":
        """A named fake device (see ``PROFILES``)."""
        try:
            return PROFILES[name]
        except KeyError:
            raise NamError(
                f"unknown device profile {name!r}; expected one of: {', '.join(sorted(PROFILES))}",
                hint="name one of them (`nam preflight --device-profile h100`, `nam train --dry-run "
                     "--device-profile h200`), or omit it to probe this machine",
                exit_code=2,
            ) from None


def _fake(profile: str, **fields) -> DeviceInfo:
    return DeviceInfo(profile_name=profile, torch_version="n/a", **fields)


GiB = 1024**3

PROFILES: dict[str, DeviceInfo] = {
    "cpu": _fake("cpu", kind="cpu", name="cpu"),
    # H100 SXM 80GB: sm_90, 232,448 B opt-in smem per block (read on our H100 host), 132 SMs; 79.18 GiB as CUDA
    # reports it ("a total capacity of 79.18 GiB" in bench/results/period.json's out-of-memory error).
    "h100": _fake(
        "h100", kind="cuda", name="NVIDIA H100 80GB HBM3", capability=(9, 0),
        smem_per_block_optin=232_448, sm_count=132, memory_bytes=round(79.18 * GiB), device_count=1,
        cuda_version="13.0",
    ),
    # H200 141GB: same SM as H100 (sm_90, 232,448 B), more and faster HBM: 139.80 GiB as CUDA reports it (the
    # out-of-memory error quoted at nam56r/memory.py's H200_GIB).
    "h200": _fake(
        "h200", kind="cuda", name="NVIDIA H200", capability=(9, 0),
        smem_per_block_optin=232_448, sm_count=132, memory_bytes=round(139.80 * GiB), device_count=1,
        cuda_version="13.0",
    ),
    # DGX Spark GB10: sm_121 with 99 KiB = 101,376 B opt-in smem per block; 128 GB unified memory.
    "gb10": _fake(
        "gb10", kind="cuda", name="NVIDIA GB10", capability=(12, 1),
        smem_per_block_optin=101_376, sm_count=48, memory_bytes=128 * GiB, device_count=1, cuda_version="13.0",
    ),
}
