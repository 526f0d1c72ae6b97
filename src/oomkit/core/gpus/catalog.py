"""The built-in device catalog: 28 NVIDIA GPUs as PyTorch sees them.

``total_memory_bytes`` is ``torch.cuda.get_device_properties(0).total_memory``. It is not the
marketing size (an "80GB" A100 reports 79.21 GiB) and it moves by up to a few hundred MiB with the
driver version, so every entry names the output it was copied from and the driver that printed
it. Sources, in order of preference:

- deviceQuery: the CUDA sample ``deviceQuery`` prints ``cudaDeviceProp.totalGlobalMem``, the field
  PyTorch reports, byte-exact ("Total amount of global memory: N MBytes (B bytes)");
- mem_get_info: the total half of ``torch.cuda.mem_get_info()`` (``cudaMemGetInfo``), byte-exact;
- derived: only a ``_CudaDeviceProperties(... total_memory=NMB)`` print was found; PyTorch prints
  ``total_memory // 2**20`` there, so the figure is N * 2**20, at most 1 MiB low. Two entries
  (L40, H200 NVL) carry over a sibling's CUDA figure: no CUDA output was found for them, and
  ``nvidia-smi`` reports the same total for both devices of each pair (same memory chips and
  size); their notes say so.

AMD GPUs (MI300X) are not in the catalog: see ``lookup.NOT_MODELLED``.

Outputs quoted from public GitHub files found by code search carry the quoted line; GitHub issue
and pull request threads carry their address. Bandwidths are peak DRAM figures in GB/s from
NVIDIA's product datasheets. Compute capabilities are NVIDIA's "CUDA GPUs" table and match the
``major``/``minor`` in the quoted outputs. SM counts (``multi_processor_count``: reductions size
their grids, and so their staging memory, by them) come from a quoted ``_CudaDeviceProperties``
print or deviceQuery where one was found, else from NVIDIA's architecture whitepaper or
datasheet (CUDA cores divided by the architecture's cores per SM, where only those are given).
"""

from __future__ import annotations

from oomkit.core.gpus.overhead import context_overhead_bytes, context_overhead_note
from oomkit.core.gpus.spec import Architecture, GpuSpec, MemorySource

__all__ = ["CATALOG"]


def _gpu(
    name: str,
    *,
    aliases: tuple[str, ...],
    total_memory_bytes: int,
    source: MemorySource,
    memory_note: str,
    compute_capability: tuple[int, int],
    architecture: Architecture,
    bandwidth_gb_per_s: float,
    bandwidth_note: str,
    multiprocessor_count: int,
    multiprocessor_note: str,
) -> GpuSpec:
    return GpuSpec(
        name=name,
        aliases=aliases,
        total_memory_bytes=total_memory_bytes,
        context_overhead_bytes=context_overhead_bytes(architecture),
        compute_capability=compute_capability,
        architecture=architecture,
        memory_bandwidth_gb_per_s=bandwidth_gb_per_s,
        multiprocessor_count=multiprocessor_count,
        total_memory_source=source,
        source_notes=(
            f"total memory ({source}): {memory_note}",
            context_overhead_note(architecture),
            f"bandwidth: {bandwidth_note}",
            f"SMs: {multiprocessor_note}",
        ),
    )


CATALOG: tuple[GpuSpec, ...] = (
    # --- Pascal (sm_60) ------------------------------------------------------------------------
    _gpu(
        "P100 16GB",
        aliases=("p100", "p100-16gb", "p100-pcie-16gb", "tesla p100-pcie-16gb"),
        # deviceQuery "Tesla P100-PCIE-16GB", drivers 10.2 and 11.4: "16281 MBytes
        # (17071734784 bytes)"; Colab's torch prints total_memory=16280MB, the same figure.
        total_memory_bytes=17_071_734_784,
        source="cudaDeviceProp",
        memory_note='deviceQuery "Tesla P100-PCIE-16GB", drivers 10.2 and 11.4: 16281 MBytes '
        "(17071734784 bytes); Colab's get_device_properties prints total_memory=16280MB",
        compute_capability=(6, 0),
        architecture="Pascal",
        bandwidth_gb_per_s=732.0,
        bandwidth_note="NVIDIA Tesla P100 datasheet, 732 GB/s (16GB)",
        multiprocessor_count=56,
        multiprocessor_note="NVIDIA Tesla P100 whitepaper: 56 SMs",
    ),
    # --- Volta (sm_70) -------------------------------------------------------------------------
    _gpu(
        "V100 16GB",
        aliases=("v100-16gb", "v100-sxm2-16gb", "v100-pcie-16gb", "tesla v100-sxm2-16gb"),
        # deviceQuery, driver 12.4 / runtime 12.4: "16144 MBytes (16928342016 bytes)"
        # (older drivers: 16160 MiB = 16945512448 with CUDA 9.0, 16128 MiB with CUDA 11.0).
        total_memory_bytes=16_928_342_016,
        source="cudaDeviceProp",
        memory_note='deviceQuery "Tesla V100-SXM2-16GB", driver 12.4: 16144 MBytes (16928342016 bytes); '
        "16945512448 under CUDA 9.0 drivers",
        compute_capability=(7, 0),
        architecture="Volta",
        bandwidth_gb_per_s=900.0,
        bandwidth_note="NVIDIA V100 datasheet, 900 GB/s (SXM2 and PCIe)",
        multiprocessor_count=80,
        multiprocessor_note="NVIDIA Tesla V100 (Volta) whitepaper: 80 SMs",
    ),
    _gpu(
        "V100 32GB",
        aliases=("v100-32gb", "v100-sxm2-32gb", "v100-pcie-32gb", "tesla v100-sxm2-32gb"),
        # deviceQuery on SDSC Expanse, driver 11.6: "32511 MBytes (34089926656 bytes)"; the same
        # 34089926656 is the mem_get_info total quoted for a "V100 session" in another project.
        total_memory_bytes=34_089_926_656,
        source="cudaDeviceProp",
        memory_note='deviceQuery "Tesla V100-SXM2-32GB", driver 11.6: 32511 MBytes (34089926656 bytes); '
        "same total from torch.cuda.mem_get_info in an independent project comment",
        compute_capability=(7, 0),
        architecture="Volta",
        bandwidth_gb_per_s=900.0,
        bandwidth_note="NVIDIA V100 datasheet, 900 GB/s (SXM2 and PCIe)",
        multiprocessor_count=80,
        multiprocessor_note="NVIDIA Tesla V100 (Volta) whitepaper: 80 SMs",
    ),
    # --- Turing (sm_75) ------------------------------------------------------------------------
    _gpu(
        "T4",
        aliases=("t4", "tesla t4"),
        # deviceQuery: "15109 MBytes (15843524608 bytes)"; Colab's get_device_properties prints
        # total_memory=15109MB, the same figure (drivers vary from 14918 to 15110 MiB).
        total_memory_bytes=15_843_524_608,
        source="cudaDeviceProp",
        memory_note='deviceQuery "Tesla T4": 15109 MBytes (15843524608 bytes); matches the '
        "total_memory=15109MB that Colab prints; 14918-15110 MiB across drivers",
        compute_capability=(7, 5),
        architecture="Turing",
        bandwidth_gb_per_s=320.0,
        bandwidth_note="NVIDIA T4 datasheet, 320 GB/s",
        multiprocessor_count=40,
        multiprocessor_note="_CudaDeviceProperties(name='Tesla T4', major=7, minor=5, total_memory=15109MB, "
        "multi_processor_count=40) (Colab)",
    ),
    # --- Ampere (sm_80, sm_86) -----------------------------------------------------------------
    _gpu(
        "A100 40GB",
        aliases=("a100-40gb", "a100-sxm4-40gb", "a100-pcie-40gb", "nvidia a100-sxm4-40gb"),
        # deviceQuery, driver 12.2: "40339 MBytes (42298834944 bytes)", the same for SXM4
        # (bottlerocket-os/bottlerocket#3873) and PCIe (two independent deviceQuery outputs).
        total_memory_bytes=42_298_834_944,
        source="cudaDeviceProp",
        memory_note="deviceQuery NVIDIA A100-SXM4-40GB, driver 12.2: 40339 MBytes (42298834944 bytes) "
        "(https://github.com/bottlerocket-os/bottlerocket/pull/3873); A100-PCIE-40GB reports the "
        "same under driver 12.2",
        compute_capability=(8, 0),
        architecture="Ampere",
        bandwidth_gb_per_s=1555.0,
        bandwidth_note="NVIDIA A100 datasheet, 1,555 GB/s (40GB)",
        multiprocessor_count=108,
        multiprocessor_note="NVIDIA A100 Tensor Core GPU architecture whitepaper: 108 SMs",
    ),
    _gpu(
        "A100 80GB PCIe",
        aliases=("a100-80gb-pcie", "a100-pcie-80gb", "nvidia a100 80gb pcie"),
        # deviceQuery, driver 12.4: "81038 MBytes (84974239744 bytes)".
        total_memory_bytes=84_974_239_744,
        source="cudaDeviceProp",
        memory_note='deviceQuery "NVIDIA A100 80GB PCIe", driver 12.4: 81038 MBytes (84974239744 bytes)',
        compute_capability=(8, 0),
        architecture="Ampere",
        bandwidth_gb_per_s=1935.0,
        bandwidth_note="NVIDIA A100 datasheet, 1,935 GB/s (80GB PCIe)",
        multiprocessor_count=108,
        multiprocessor_note="NVIDIA A100 Tensor Core GPU architecture whitepaper: 108 SMs",
    ),
    _gpu(
        "A100 80GB SXM",
        aliases=(
            "a100-80gb",
            "a100-sxm",
            "a100-sxm4-80gb",
            "a100-80gb-sxm",
            "nvidia a100-sxm4-80gb",
        ),
        # torch.cuda.mem_get_info total quoted for an "A100 session": 85051572224 (79.21 GiB).
        # deviceQuery shows 84987740160 (driver 12.2) to 85100068864 (driver 12.5).
        total_memory_bytes=85_051_572_224,
        source="cudaMemGetInfo",
        memory_note="torch.cuda.mem_get_info total 85051572224 quoted in a public project comment; "
        "deviceQuery A100-SXM4-80GB shows 84987740160 (driver 12.2) to 85100068864 (driver 12.5)",
        compute_capability=(8, 0),
        architecture="Ampere",
        bandwidth_gb_per_s=2039.0,
        bandwidth_note="NVIDIA A100 datasheet, 2,039 GB/s (80GB SXM)",
        multiprocessor_count=108,
        multiprocessor_note="NVIDIA A100 Tensor Core GPU architecture whitepaper: 108 SMs",
    ),
    _gpu(
        "A10G",
        aliases=("a10g", "nvidia a10g"),
        # _CudaDeviceProperties(name='NVIDIA A10G', major=8, minor=6, total_memory=22587MB, ...)
        # with torch 2.x+cu130: derived 22587 * 2**20.
        total_memory_bytes=22_587 * 2**20,
        source="derived",
        memory_note="derived: 22587 * 2**20 from get_device_properties print total_memory=22587MB "
        "(torch +cu130, AWS g5)",
        compute_capability=(8, 6),
        architecture="Ampere",
        bandwidth_gb_per_s=600.0,
        bandwidth_note="AWS EC2 G5 documentation, 600 GB/s per A10G",
        multiprocessor_count=80,
        multiprocessor_note="_CudaDeviceProperties(name='NVIDIA A10G', major=8, minor=6, ..., "
        "multi_processor_count=80) (torch +cu130, AWS)",
    ),
    _gpu(
        "A10",
        aliases=("a10", "nvidia a10"),
        # deviceQuery, driver 12.8 / runtime 12.9: "22599 MBytes (23696375808 bytes)"
        # (driver 12.2: 22516 MBytes, 23609475072 bytes).
        total_memory_bytes=23_696_375_808,
        source="cudaDeviceProp",
        memory_note='deviceQuery "NVIDIA A10", driver 12.8: 22599 MBytes (23696375808 bytes); '
        "23609475072 under driver 12.2",
        compute_capability=(8, 6),
        architecture="Ampere",
        bandwidth_gb_per_s=600.0,
        bandwidth_note="NVIDIA A10 datasheet, 600 GB/s",
        multiprocessor_count=72,
        multiprocessor_note="NVIDIA A10 datasheet: 9,216 CUDA cores, 128 per Ampere GA10x SM = 72 SMs",
    ),
    _gpu(
        "RTX 3080",
        aliases=("rtx3080", "rtx-3080", "3080", "nvidia geforce rtx 3080"),
        # deviceQuery (Windows, driver 11.7): "10240 MBytes (10736893952 bytes)". A Linux desktop
        # with a display showed 9987 MBytes; a display takes memory too.
        total_memory_bytes=10_736_893_952,
        source="cudaDeviceProp",
        memory_note='deviceQuery "NVIDIA GeForce RTX 3080" (10GB), driver 11.7: 10240 MBytes '
        "(10736893952 bytes)",
        compute_capability=(8, 6),
        architecture="Ampere",
        bandwidth_gb_per_s=760.0,
        bandwidth_note="NVIDIA GeForce RTX 3080 (10GB) specifications, 760 GB/s",
        multiprocessor_count=68,
        multiprocessor_note="NVIDIA Ampere GA102 whitepaper: GeForce RTX 3080, 68 SMs",
    ),
    _gpu(
        "RTX 3090",
        aliases=("rtx3090", "rtx-3090", "3090", "nvidia geforce rtx 3090"),
        # deviceQuery, driver 11.8 (Linux): "24268 MBytes (25447170048 bytes)"; nvidia-smi shows
        # the same 24268MiB total (pytorch/pytorch#54564).
        total_memory_bytes=25_447_170_048,
        source="cudaDeviceProp",
        memory_note='deviceQuery "NVIDIA GeForce RTX 3090", driver 11.8: 24268 MBytes (25447170048 bytes); '
        "nvidia-smi 24268MiB in https://github.com/pytorch/pytorch/issues/54564",
        compute_capability=(8, 6),
        architecture="Ampere",
        bandwidth_gb_per_s=936.0,
        bandwidth_note="NVIDIA GeForce RTX 3090 specifications, 936 GB/s",
        multiprocessor_count=82,
        multiprocessor_note="NVIDIA Ampere GA102 whitepaper: GeForce RTX 3090, 82 SMs",
    ),
    _gpu(
        "RTX A6000",
        aliases=("a6000", "rtx-a6000", "rtxa6000", "nvidia rtx a6000"),
        # deviceQuery, driver 12.7: "48790 MBytes (51160023040 bytes)".
        total_memory_bytes=51_160_023_040,
        source="cudaDeviceProp",
        memory_note='deviceQuery "NVIDIA RTX A6000", driver 12.7: 48790 MBytes (51160023040 bytes)',
        compute_capability=(8, 6),
        architecture="Ampere",
        bandwidth_gb_per_s=768.0,
        bandwidth_note="NVIDIA RTX A6000 datasheet, 768 GB/s",
        multiprocessor_count=84,
        multiprocessor_note="NVIDIA Ampere GA102 whitepaper: RTX A6000, 84 SMs",
    ),
    _gpu(
        "RTX 3060 12GB",
        aliases=("rtx3060", "rtx-3060", "3060", "rtx3060-12gb", "nvidia geforce rtx 3060"),
        # deviceQuery "NVIDIA GeForce RTX 3060", drivers 12.0, 12.6 and 12.8: "12288 MBytes
        # (12884377600 bytes)" (three independent outputs); a host with a display attached
        # showed 12044 MBytes (12629508096 bytes) under driver 12.2.
        total_memory_bytes=12_884_377_600,
        source="cudaDeviceProp",
        memory_note='deviceQuery "NVIDIA GeForce RTX 3060", drivers 12.0/12.6/12.8: 12288 MBytes '
        "(12884377600 bytes); 12629508096 on a driver 12.2 host",
        compute_capability=(8, 6),
        architecture="Ampere",
        bandwidth_gb_per_s=360.0,
        bandwidth_note="derived: 15 Gbps GDDR6 x 192-bit / 8 (NVIDIA GeForce RTX 3060 specifications)",
        multiprocessor_count=28,
        multiprocessor_note="NVIDIA GeForce RTX 3060 specifications: 3,584 CUDA cores, 128 per SM = 28",
    ),
    _gpu(
        "A40",
        aliases=("a40", "nvidia a40"),
        # deviceQuery "NVIDIA A40", driver 12.4 / runtime 12.4: "45403 MBytes (47608692736
        # bytes)"; another host's torch printed total_memory=45416MB.
        total_memory_bytes=47_608_692_736,
        source="cudaDeviceProp",
        memory_note='deviceQuery "NVIDIA A40", driver 12.4: 45403 MBytes (47608692736 bytes); '
        "another host printed total_memory=45416MB",
        compute_capability=(8, 6),
        architecture="Ampere",
        bandwidth_gb_per_s=696.0,
        bandwidth_note="NVIDIA A40 datasheet, 696 GB/s",
        multiprocessor_count=84,
        multiprocessor_note="NVIDIA A40 datasheet: 10,752 CUDA cores, 128 per SM = 84 SMs",
    ),
    # --- Ada Lovelace (sm_89) ------------------------------------------------------------------
    _gpu(
        "L4",
        aliases=("l4", "nvidia l4"),
        # deviceQuery, driver 12.0: "22518 MBytes (23612293120 bytes)".
        total_memory_bytes=23_612_293_120,
        source="cudaDeviceProp",
        memory_note='deviceQuery "NVIDIA L4", driver 12.0: 22518 MBytes (23612293120 bytes)',
        compute_capability=(8, 9),
        architecture="Ada Lovelace",
        bandwidth_gb_per_s=300.0,
        bandwidth_note="NVIDIA L4 datasheet, 300 GB/s",
        multiprocessor_count=58,
        multiprocessor_note="NVIDIA L4 datasheet: 7,424 CUDA cores, 128 per Ada SM = 58 SMs",
    ),
    _gpu(
        "RTX 4080",
        aliases=("rtx4080", "rtx-4080", "4080", "nvidia geforce rtx 4080"),
        # _CudaDeviceProperties(name='NVIDIA GeForce RTX 4080', major=8, minor=9,
        # total_memory=16049MB, ...): derived 16049 * 2**20.
        total_memory_bytes=16_049 * 2**20,
        source="derived",
        memory_note="derived: 16049 * 2**20 from get_device_properties print total_memory=16049MB",
        compute_capability=(8, 9),
        architecture="Ada Lovelace",
        bandwidth_gb_per_s=716.8,
        bandwidth_note="derived: 22.4 Gbps GDDR6X x 256-bit / 8 (NVIDIA RTX 4080 specifications)",
        multiprocessor_count=76,
        multiprocessor_note="NVIDIA Ada Lovelace architecture whitepaper: GeForce RTX 4080 (16GB), "
        "76 SMs",
    ),
    _gpu(
        "RTX 4090",
        aliases=("rtx4090", "rtx-4090", "4090", "nvidia geforce rtx 4090"),
        # deviceQuery, driver 12.1 (Linux): "24564 MBytes (25756696576 bytes)". Windows (WDDM)
        # reports less: 23028 MBytes (24146083840 bytes) under driver 12.6.
        total_memory_bytes=25_756_696_576,
        source="cudaDeviceProp",
        memory_note='deviceQuery "NVIDIA GeForce RTX 4090", driver 12.1 Linux: 24564 MBytes '
        "(25756696576 bytes); Windows WDDM shows 24146083840",
        compute_capability=(8, 9),
        architecture="Ada Lovelace",
        bandwidth_gb_per_s=1008.0,
        bandwidth_note="NVIDIA Ada GPU architecture whitepaper, 1,008 GB/s",
        multiprocessor_count=128,
        multiprocessor_note="_CudaDeviceProperties(name='NVIDIA GeForce RTX 4090', major=8, minor=9, "
        "total_memory=24563MB, multi_processor_count=128)",
    ),
    _gpu(
        "L40",
        aliases=("l40", "nvidia l40"),
        # No CUDA output found for the L40. nvidia-smi reports "NVIDIA L40, 46068 MiB" (several
        # hosts) and "NVIDIA L40S, 46068 MiB" (modal-labs/modal-client#2797 and others): the
        # same 48 GB GDDR6 with ECC, so the L40S's deviceQuery total (driver 12.4, 47576711168
        # bytes) is taken. Measure it with torch.cuda.mem_get_info() where it matters.
        total_memory_bytes=47_576_711_168,
        source="derived",
        memory_note="derived: a sibling's figure, the L40S's deviceQuery total 47576711168 (driver "
        "12.4); nvidia-smi shows 46068 MiB for both the L40 and the L40S",
        compute_capability=(8, 9),
        architecture="Ada Lovelace",
        bandwidth_gb_per_s=864.0,
        bandwidth_note="NVIDIA L40 datasheet, 864 GB/s",
        multiprocessor_count=142,
        multiprocessor_note="NVIDIA L40 datasheet: 18,176 CUDA cores, 128 per Ada SM = 142 SMs",
    ),
    _gpu(
        "L40S",
        aliases=("l40s", "nvidia l40s"),
        # deviceQuery (cuda-device-query crate README), driver 12.4: "45373 MBytes
        # (47576711168 bytes)". A Kubernetes pod printed total_memory=45589MB.
        total_memory_bytes=47_576_711_168,
        source="cudaDeviceProp",
        memory_note='deviceQuery "NVIDIA L40S", driver 12.4: 45373 MBytes (47576711168 bytes); '
        "another host printed total_memory=45589MB",
        compute_capability=(8, 9),
        architecture="Ada Lovelace",
        bandwidth_gb_per_s=864.0,
        bandwidth_note="NVIDIA L40S datasheet, 864 GB/s",
        multiprocessor_count=142,
        multiprocessor_note="NVIDIA L40S datasheet: 18,176 CUDA cores, 128 per Ada SM = 142 SMs",
    ),
    _gpu(
        "RTX 6000 Ada",
        aliases=("rtx6000ada", "rtx-6000-ada", "6000ada", "nvidia rtx 6000 ada generation"),
        # unslothai/unsloth-zoo PR #1053: get_device_properties(0).total_memory and
        # mem_get_info(0) total both "exactly 50,865,307,648 bytes" (PyTorch 2.10.0+cu130).
        total_memory_bytes=50_865_307_648,
        source="cudaDeviceProp",
        memory_note="get_device_properties and mem_get_info both 50865307648, PyTorch 2.10.0+cu130 "
        "(https://github.com/unslothai/unsloth-zoo/pull/1053)",
        compute_capability=(8, 9),
        architecture="Ada Lovelace",
        bandwidth_gb_per_s=960.0,
        bandwidth_note="NVIDIA RTX 6000 Ada datasheet, 960 GB/s",
        multiprocessor_count=142,
        multiprocessor_note="NVIDIA RTX 6000 Ada datasheet: 18,176 CUDA cores, 128 per SM = 142 SMs",
    ),
    # --- Hopper (sm_90) ------------------------------------------------------------------------
    _gpu(
        "H100 PCIe",
        aliases=("h100-pcie", "h100pcie", "nvidia h100 pcie"),
        # _CudaDeviceProperties(name='NVIDIA H100 PCIe', major=9, minor=0, total_memory=81008MB,
        # multi_processor_count=114): derived 81008 * 2**20.
        total_memory_bytes=81_008 * 2**20,
        source="derived",
        memory_note="derived: 81008 * 2**20 from get_device_properties print total_memory=81008MB",
        compute_capability=(9, 0),
        architecture="Hopper",
        bandwidth_gb_per_s=2000.0,
        bandwidth_note="NVIDIA H100 datasheet, 2 TB/s (PCIe)",
        multiprocessor_count=114,
        multiprocessor_note="_CudaDeviceProperties(name='NVIDIA H100 PCIe', ..., "
        "multi_processor_count=114)",
    ),
    _gpu(
        "H100 SXM 80GB",
        aliases=(
            "h100",
            "h100-sxm",
            "h100sxm",
            "h100-80gb",
            "h100-80gb-hbm3",
            "nvidia h100 80gb hbm3",
        ),
        # deviceQuery, driver 12.8 / runtime 12.5: "81090 MBytes (85028896768 bytes)"; torch
        # prints total_memory=81090MB on the same generation of drivers. Other drivers: 81079 to
        # 81106 MiB; nvidia-smi shows 81559MiB (modal-labs/modal-client#2797).
        total_memory_bytes=85_028_896_768,
        source="cudaDeviceProp",
        memory_note='deviceQuery "NVIDIA H100 80GB HBM3", driver 12.8: 81090 MBytes (85028896768 bytes); '
        "81079-81106 MiB across drivers; nvidia-smi's 81559MiB "
        "(https://github.com/modal-labs/modal-client/pull/2797) is not what CUDA reports",
        compute_capability=(9, 0),
        architecture="Hopper",
        bandwidth_gb_per_s=3350.0,
        bandwidth_note="NVIDIA H100 datasheet, 3.35 TB/s (SXM)",
        multiprocessor_count=132,
        multiprocessor_note="NVIDIA H100 Tensor Core GPU architecture whitepaper: 132 SMs (SXM5)",
    ),
    _gpu(
        "H100 NVL",
        aliases=("h100nvl", "h100-nvl", "h100-94gb", "nvidia h100 nvl"),
        # A GPU benchmark report's cudaDeviceProp dump (driver 12.8, nvcc 12.9):
        # "totalGlobalMem | 99960750080 bytes" for "NVIDIA H100 NVL" (95330 MiB); fastfetch
        # issue #1658 shows a DRM total of 99961274368 for the same device.
        total_memory_bytes=99_960_750_080,
        source="cudaDeviceProp",
        memory_note='cudaDeviceProp.totalGlobalMem 99960750080 bytes for "NVIDIA H100 NVL", driver '
        "12.8 (a public GPU benchmark report); DRM reports 99961274368 "
        "(https://github.com/fastfetch-cli/fastfetch/issues/1658)",
        compute_capability=(9, 0),
        architecture="Hopper",
        bandwidth_gb_per_s=3900.0,
        bandwidth_note="NVIDIA H100 datasheet, 3.9 TB/s (H100 NVL)",
        multiprocessor_count=132,
        multiprocessor_note="taken as the H100 SXM's 132 SMs (the same GH100 configuration); no deviceQuery or "
        "_CudaDeviceProperties print of an H100 NVL found",
    ),
    _gpu(
        "H200",
        aliases=("h200", "h200-sxm", "h200-141gb", "nvidia h200"),
        # _CudaDeviceProperties(name='NVIDIA H200', major=9, minor=0, total_memory=143156MB,
        # multi_processor_count=132, ...): derived 143156 * 2**20.
        total_memory_bytes=143_156 * 2**20,
        source="derived",
        memory_note="derived: 143156 * 2**20 from get_device_properties print total_memory=143156MB",
        compute_capability=(9, 0),
        architecture="Hopper",
        bandwidth_gb_per_s=4800.0,
        bandwidth_note="NVIDIA H200 datasheet, 4.8 TB/s",
        multiprocessor_count=132,
        multiprocessor_note="_CudaDeviceProperties(name='NVIDIA H200', ..., multi_processor_count=132)",
    ),
    _gpu(
        "H200 NVL",
        aliases=("h200nvl", "h200-nvl", "nvidia h200 nvl"),
        # No CUDA output found for the H200 NVL. nvidia-smi reports 143771 MiB for it (several
        # hosts: "NVIDIA H200 NVL (143771 MiB, driver 570.195.03)") and the same 143771 MiB for
        # the H200 SXM, whose torch print is total_memory=143156MB: the same 141 GB HBM3e, so
        # that figure is taken.
        total_memory_bytes=143_156 * 2**20,
        source="derived",
        memory_note="derived: a sibling's figure, the H200's 143156 * 2**20 (torch print "
        "total_memory=143156MB); nvidia-smi shows 143771 MiB for both the H200 and the H200 NVL",
        compute_capability=(9, 0),
        architecture="Hopper",
        bandwidth_gb_per_s=4800.0,
        bandwidth_note="NVIDIA H200 datasheet, 4.8 TB/s (H200 NVL)",
        multiprocessor_count=132,
        multiprocessor_note="taken as the H200's measured 132 SMs (the same GH100 configuration); no deviceQuery or "
        "_CudaDeviceProperties print of an H200 NVL found",
    ),
    _gpu(
        "GH200 96GB",
        aliases=("gh200", "gh200-96gb", "gh200-480gb", "nvidia gh200 480gb"),
        # deviceQuery "NVIDIA GH200 480GB" (the 96 GB HBM3 Grace Hopper superchip; 480GB is the
        # Grace side's LPDDR5X), driver 12.2 / runtime 12.4: "97280 MBytes (102005473280 bytes)".
        total_memory_bytes=102_005_473_280,
        source="cudaDeviceProp",
        memory_note='deviceQuery "NVIDIA GH200 480GB", driver 12.2: 97280 MBytes (102005473280 '
        "bytes); the 144 GB HBM3e GH200 is a different device",
        compute_capability=(9, 0),
        architecture="Hopper",
        bandwidth_gb_per_s=4000.0,
        bandwidth_note="NVIDIA GH200 Grace Hopper Superchip datasheet, 4 TB/s (96GB HBM3)",
        multiprocessor_count=132,
        multiprocessor_note="NVIDIA Grace Hopper superchip whitepaper: the H100 GPU with 132 SMs",
    ),
    # --- Blackwell (sm_100) --------------------------------------------------------------------
    _gpu(
        "B200",
        aliases=("b200", "nvidia b200"),
        # _CudaDeviceProperties(name='NVIDIA B200', major=10, minor=0, total_memory=182642MB,
        # multi_processor_count=148, ...): derived 182642 * 2**20 (another host: 182631MB).
        total_memory_bytes=182_642 * 2**20,
        source="derived",
        memory_note="derived: 182642 * 2**20 from get_device_properties print total_memory=182642MB "
        "(another host printed 182631MB)",
        compute_capability=(10, 0),
        architecture="Blackwell",
        bandwidth_gb_per_s=8000.0,
        bandwidth_note="NVIDIA HGX B200 datasheet, 8 TB/s per GPU",
        multiprocessor_count=148,
        multiprocessor_note="_CudaDeviceProperties(name='NVIDIA B200', ..., multi_processor_count=148)",
    ),
    # --- Blackwell, GeForce (sm_120) -----------------------------------------------------------
    _gpu(
        "RTX 5090",
        aliases=("rtx5090", "rtx-5090", "5090", "nvidia geforce rtx 5090"),
        # deviceQuery "NVIDIA GeForce RTX 5090", driver 13.0 / runtime 12.8: "32101 MBytes
        # (33660534784 bytes)" (two files of one project); another host: 32109 MBytes
        # (33668857856 bytes).
        total_memory_bytes=33_660_534_784,
        source="cudaDeviceProp",
        memory_note='deviceQuery "NVIDIA GeForce RTX 5090", driver 13.0: 32101 MBytes '
        "(33660534784 bytes); another host 33668857856",
        compute_capability=(12, 0),
        architecture="Blackwell",
        bandwidth_gb_per_s=1792.0,
        bandwidth_note="derived: 28 Gbps GDDR7 x 512-bit / 8 (NVIDIA GeForce RTX 5090 specifications)",
        multiprocessor_count=170,
        multiprocessor_note="NVIDIA RTX Blackwell GPU architecture whitepaper: GeForce RTX 5090, 170 SMs",
    ),
)
