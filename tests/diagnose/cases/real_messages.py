"""Real OOM messages pasted in public GitHub issues, each labelled from its own numbers.

Gathered for issue 14 item 5 with the public-issue search (queries such as "CUDA out of memory.
Tried to allocate"), across every wording PyTorch has printed: up to 1.3 and 1.4 ("N cached"),
1.5-2.0 ("reserved in total by PyTorch"), 2.1 ("total capacty"), 2.2+ (with and without NVML's
process sentences, private pools), ROCm's "HIP out of memory" and backend:cudaMallocAsync. Each
message is kept as the issue shows it (prefixes, line breaks, a lost parenthesis); ``url`` is
where it was pasted. Messages whose figures leave room for the request (free >= requested: the
memory went elsewhere between the failed cudaMalloc and the message, which the text cannot
show) were left out, as were exact duplicates.

Labels, from the message's own figures (``Q`` requested, ``T`` total, ``F`` free, ``A``
allocated, ``R`` reserved, ``U = R - A`` the cache, ``O = T - F - R`` outside the allocator):

- ``request_exceeds_device``: ``Q > T``.
- ``outside_pytorch``: ``O`` clearly above a CUDA context and its libraries (more than ~1.2 GiB
  with 2.1+, ~2.4 GiB with the eager-loading era's wording) or other processes named by NVML,
  and freeing it would have covered ``Q - F``.
- ``fragmentation``: a cache at least as large as ``Q`` (PyTorch released every wholly free
  cached segment and retried before raising, so those bytes sat in blocks too small for the
  request: issue 35 item 6), or a cache of at least 5% of ``R`` (or 1 GiB) that, with ``F``,
  covers ``Q``.
- ``shortage``: the rest: the tensors (with an ordinary cache under 5%) fill the device.

Issue 35 relabelled eight messages from ``shortage`` to ``fragmentation`` by the first rule (each
carries its cache and request in its comment) and added four; the classifier of main eb25551 gets
56 of these 65 right under these labels.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RealCase:
    url: str
    text: str
    expected: str


_GH = "https://github.com/"
_TAIL_22 = (
    " If reserved but unallocated memory is large try setting "
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation "
    "for Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
)
_TAIL_21 = (
    " If reserved but unallocated memory is large try setting max_split_size_mb to avoid "
    "fragmentation.  See documentation for Memory Management and PYTORCH_CUDA_ALLOC_CONF"
)
_TAIL_20 = (
    " If reserved memory is >> allocated memory try setting max_split_size_mb to avoid "
    "fragmentation.  See documentation for Memory Management and PYTORCH_CUDA_ALLOC_CONF"
)

CASES: tuple[RealCase, ...] = (
    # --- 2.2+ ---------------------------------------------------------------------------------
    RealCase(
        _GH + "murong-xu/CADS/issues/4",
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 22.78 GiB. GPU 0 has a "
        "total capacity of 31.47 GiB of which 12.73 GiB is free. Including non-PyTorch memory, "
        "this process has 18.73 GiB memory in use. Of the allocated memory 9.08 GiB is allocated "
        "by PyTorch, and 9.35 GiB is reserved by PyTorch but unallocated." + _TAIL_22,
        "shortage",  # 9.08 + 22.78 > 31.47 - 0.30; the 9.35 GiB cache + 12.73 free < 22.78
    ),
    RealCase(
        _GH + "pytorch/pytorch/issues/16417",
        "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 22.00 MiB. GPU 0 has "
        "a total capacity of 23.65 GiB of which 11.06 MiB is free. Including non-PyTorch memory, "
        "this process has 23.60 GiB memory in use. Of the allocated memory 22.90 GiB is allocated"
        " by PyTorch, and 194.87 MiB is reserved by PyTorch but unallocated." + _TAIL_22,
        "fragmentation",  # a 194.87 MiB cache >= the 22.00 MiB request (0.8% of reserved)
    ),
    RealCase(
        _GH + "lllyasviel/FramePack/issues/369",
        "...CUDA out of memory. Tried to allocate 30.29 GiB. GPU 0 has a total capacity of 10.74 "
        "GiB of which 3.69 GiB is free. Including non-PyTorch memory, this process has 6.68 GiB "
        "memory in use. Of the allocated memory 6.10 GiB is allocated by PyTorch, and 396.58 MiB"
        " is reserved by PyTorch but unallocated." + _TAIL_22,
        "request_exceeds_device",
    ),
    RealCase(
        _GH + "huggingface/meshgen/issues/7",
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1002.00 MiB. GPU 0 has a "
        "total capacity of 8.00 GiB of which 0 bytes is free. Of the allocated memory 13.98 GiB "
        "is allocated by PyTorch, and 129.48 MiB is reserved by PyTorch but unallocated."
        + _TAIL_22,
        "shortage",  # allocated beyond the device (Windows system-memory fallback)
    ),
    RealCase(
        _GH + "Tianhao-Qi/Mask2DiT/issues/4",
        "CUDA out of memory. Tried to allocate 35.60 GiB. GPU 0 has a total capacity of 79.33 "
        "GiB of which 26.16 GiB is free. Process 76883 has 53.16 GiB memory in use. Of the "
        "allocated memory 11.97 GiB is allocated by PyTorch, and 40.69 GiB is reserved by "
        "PyTorch but unallocated." + _TAIL_22,
        "fragmentation",
    ),
    RealCase(
        _GH + "antgroup/echomimic_v2/issues/115",
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 4.22 GiB. GPU 0 has a "
        "total capacity of 15.69 GiB of which 3.71 GiB is free. Including non-PyTorch memory, "
        "this process has 11.14 GiB memory in use. Of the allocated memory 10.14 GiB is "
        "allocated by PyTorch, and 771.43 MiB is reserved by PyTorch but unallocated." + _TAIL_22,
        "fragmentation",  # a 6.9% cache + 3.71 GiB free cover 4.22 GiB
    ),
    RealCase(
        _GH + "RLinf/RLinf/issues/255",
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 86.00 MiB. GPU 0 has a "
        "total capacity of 23.64 GiB of which 264.00 MiB is free. Process 2086283 has 419.48 MiB"
        " memory in use. Including non-PyTorch memory, this process has 8.04 GiB memory in use. "
        "Process 2797307 has 14.85 GiB memory in use. Of the allocated memory 7.63 GiB is "
        "allocated by PyTorch, and 40.11 MiB is reserved by PyTorch but unallocated." + _TAIL_22,
        "outside_pytorch",  # two other processes hold 15.27 GiB
    ),
    RealCase(
        _GH + "kohya-ss/sd-scripts/issues/2029",
        "[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.99 GiB. GPU 0 "
        "has a total capacity of 23.56 GiB of which 1.23 GiB is free. Including non-PyTorch "
        "memory, this process has 22.27 GiB memory in use. Of the allocated memory 14.73 GiB is "
        "allocated by PyTorch, and 6.39 GiB is reserved by PyTorch but unallocated." + _TAIL_22,
        "fragmentation",
    ),
    RealCase(
        _GH + "vllm-project/vllm/issues/27508",
        "(EngineCore_DP0 pid=8884) torch.OutOfMemoryError: CUDA out of memory. Tried to allocate"
        " 786.00 MiB. GPU 0 has a total capacity of 79.11 GiB of which 140.75 MiB is free. "
        "Process 3270336 has 78.96 GiB memory in use. Of the allocated memory 68.83 GiB is "
        "allocated by PyTorch, with 660.00 MiB allocated in private pools (e.g., CUDA Graphs), "
        "and 331.08 MiB is reserved by PyTorch but unallocated.",
        "outside_pytorch",  # 9.8 GiB outside the allocator (vLLM's own buffers)
    ),
    RealCase(
        _GH + "vllm-project/vllm/issues/12529",
        "ERROR 03-13 09:00:43 [core.py:330] torch.OutOfMemoryError: CUDA out of memory. Tried to"
        " allocate 1.16 GiB. GPU 0 has a total capacity of 7.75 GiB of which 1.17 GiB is free. "
        "Including non-PyTorch memory, this process has 5.02 GiB memory in use. Of the allocated"
        " memory 4.81 GiB is allocated by PyTorch, and 18.97 MiB is reserved by PyTorch but "
        "unallocated." + _TAIL_22,
        "outside_pytorch",  # 1.56 GiB used by others
    ),
    RealCase(
        _GH + "vllm-project/vllm/issues/17835",
        "(VllmWorker rank=1 pid=194255) ERROR 05-08 14:46:12 [multiproc_executor.py:435] "
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 270.00 MiB. GPU 1 has a "
        "total capacity of 21.98 GiB of which 156.94 MiB is free. Including non-PyTorch memory, "
        "this process has 21.80 GiB memory in use. Of the allocated memory 21.42 GiB is "
        "allocated by PyTorch, and 24.12 MiB is reserved by PyTorch but unallocated." + _TAIL_22,
        "shortage",
    ),
    RealCase(
        _GH + "mistralai/mistral-finetune/issues/69",
        "> torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 896.00 MiB. GPU 0 "
        "has a total capacity of 21.99 GiB of which 759.38 MiB is free. Including non-PyTorch "
        "memory, this process has 0 bytes memory in use. Of the allocated memory 20.52 GiB is "
        "allocated by PyTorch, and 102.08 MiB is reserved by PyTorch but unallocated." + _TAIL_22,
        "shortage",  # NVML's "0 bytes" for this process is a container artefact
    ),
    RealCase(
        _GH + "Lightning-AI/pytorch-lightning/issues/20299",
        "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 948.00 MiB. GPU 0 has"
        " a total capacity of 31.74 GiB of which 474.12 MiB is free. Including non-PyTorch "
        "memory, this process has 30.97 GiB memory in use. Process 136372 has 306.00 MiB memory "
        "in use. Of the allocated memory 29.07 GiB is allocated by PyTorch, and 1.27 GiB is "
        "reserved by PyTorch but unallocated." + _TAIL_22,
        "fragmentation",
    ),
    RealCase(
        _GH + "spicytigermeat/LabelMakr/issues/10",
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 26.00 MiB. GPU 0 has a "
        "total capacity of 4.00 GiB of which 0 bytes is free. Of the allocated memory 6.50 GiB "
        "is allocated by PyTorch, and 333.05 MiB is reserved by PyTorch but unallocated."
        + _TAIL_22,
        "fragmentation",  # a 333.05 MiB cache >= the 26.00 MiB request
    ),
    RealCase(
        _GH + "Comfy-Org/ComfyUI/issues/6475",
        "!!! Exception during processing !!! HIP out of memory. Tried to allocate 40.00 MiB. GPU"
        " 0 has a total capacity of 15.98 GiB of which 16.00 MiB is free. Of the allocated "
        "memory 15.76 GiB is allocated by PyTorch, and 3.43 MiB is reserved by PyTorch but "
        "unallocated.",
        "shortage",  # ROCm's wording
    ),
    # --- 2.1 ("total capacty") ----------------------------------------------------------------
    RealCase(
        _GH + "carolchenyx/MGFN./issues/35",
        "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.70 GiB. GPU 0 has a"
        " total capacty of 6.00 GiB of which 0 bytes is free. Of the allocated memory 2.93 GiB "
        "is allocated by PyTorch, and 2.30 GiB is reserved by PyTorch but unallocated." + _TAIL_21,
        "fragmentation",
    ),
    RealCase(
        _GH + "wxian3/NeuroLens/issues/2",
        "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 55.57 GiB. GPU 0 has "
        "a total capacty of 12.00 GiB of which 9.02 GiB is free. Of the allocated memory 984.52 "
        "MiB is allocated by PyTorch, and 463.48 MiB is reserved by PyTorch but unallocated."
        + _TAIL_21,
        "request_exceeds_device",
    ),
    RealCase(
        _GH + "Synthintel0/MyGirlGPT/issues/11",
        "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 32.00 MiB. GPU 0 has "
        "a total capacty of 4.00 GiB of which 41.56 MiB is free. Including non-PyTorch memory, "
        "this process has 3.44 GiB memory in use. Of the allocated memory 2.58 GiB is allocated "
        "by PyTorch, and 1.90 MiB is reserved by PyTorch but unallocated." + _TAIL_21,
        "outside_pytorch",  # 0.5 GiB held by something other than this process
    ),
    RealCase(
        _GH + "FoundationVision/GenerateU/issues/10",
        "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 496.00 MiB. GPU 0 has"
        " a total capacty of 14.75 GiB of which 235.06 MiB is free. Process 20398 has 14.52 GiB "
        "memory in use. Of the allocated memory 14.06 GiB is allocated by PyTorch, and 330.42 "
        "MiB is reserved by PyTorch but unallocated." + _TAIL_21,
        "shortage",  # a 2.2% cache; the process fills the T4
    ),
    RealCase(
        _GH + "kerrj/lerf/issues/73",
        "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 3.00 GiB. GPU 0 has a"
        " total capacty of 23.65 GiB of which 1.66 GiB is free. Including non-PyTorch memory, "
        "this process has 20.81 GiB memory in use. Of the allocated memory 12.09 GiB is "
        "allocated by PyTorch, and 4.84 GiB is reserved by PyTorch but unallocated." + _TAIL_21,
        "fragmentation",
    ),
    RealCase(
        _GH + "vllm-project/vllm/issues/2140",
        "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 3.50 GiB. GPU 0 has a"
        " total capacty of 23.69 GiB of which 3.09 GiB is free. Including non-PyTorch memory, "
        "this process has 20.57 GiB memory in use. Of the allocated memory 20.13 GiB is "
        "allocated by PyTorch, and 755.50 KiB is reserved by PyTorch but unallocated." + _TAIL_21,
        "shortage",
    ),
    RealCase(
        _GH + "hahnyuan/PB-LLM/issues/3",
        "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 172.00 MiB. GPU 0 has"
        " a total capacty of 79.33 GiB of which 49.81 MiB is free. Including non-PyTorch memory,"
        " this process has 79.27 GiB memory in use. Of the allocated memory 74.53 GiB is "
        "allocated by PyTorch, and 4.23 GiB is reserved by PyTorch but unallocated." + _TAIL_21,
        "fragmentation",
    ),
    RealCase(
        _GH + "JarodMica/ai-voice-cloning/issues/62",
        "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 12.00 MiB. GPU 0 has "
        "a total capacty of 2.00 GiB of which 0 bytes is free. Of the allocated memory 472.67 "
        "MiB is allocated by PyTorch, and 3.33 MiB is reserved by PyTorch but unallocated."
        + _TAIL_21,
        "outside_pytorch",  # 1.54 GiB of a 2 GiB GPU outside this process's allocator
    ),
    # --- 1.5-2.0 ("reserved in total by PyTorch") ----------------------------------------------
    RealCase(
        _GH + "YingqianWang/iPASSR/issues/9",
        "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 10.73 GiB (GPU 0; "
        "8.00 GiB total capacity; 17.20 GiB already allocated; 0 bytes free; 19.15 GiB reserved "
        "in total by PyTorch)" + _TAIL_20,
        "request_exceeds_device",
    ),
    RealCase(
        _GH + "TorRient/localGPT-falcon/issues/7",
        "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.63 GiB (GPU 0; "
        "44.56 GiB total capacity; 27.91 GiB already allocated; 565.31 MiB free; 27.93 GiB "
        "reserved in total by PyTorch) If reserved memory is >> allocated memory try setting "
        "max_split_size_mb to avoid fragmentation. See documentation for Memory Management and "
        "PYTORCH_CUDA_ALLOC_CONF",
        "outside_pytorch",  # 16 GiB held by another process
    ),
    RealCase(
        _GH + "One-2-3-45/One-2-3-45/issues/25",
        "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.69 GiB (GPU 0; "
        "14.56 GiB total capacity; 649.97 MiB already allocated; 1.31 GiB free; 1.01 GiB "
        "reserved in total by PyTorch)" + _TAIL_20,
        "outside_pytorch",  # 12.2 GiB held elsewhere
    ),
    RealCase(
        _GH + "Li-Chongyi/Zero-DCE/issues/52",
        "OutOfMemoryError: CUDA out of memory. Tried to allocate 1.71 GiB (GPU 0; 6.00 GiB total "
        "capacity; 3.49 GiB already allocated; 1.04 GiB free; 3.50 GiB reserved in total by "
        "PyTorch)" + _TAIL_20,
        "shortage",
    ),
    RealCase(
        _GH + "singhsourabh/Resume-NER/issues/4",
        "RuntimeError: CUDA out of memory. Tried to allocate 92.00 MiB (GPU 0; 1.96 GiB total "
        "capacity; 1.46 GiB already allocated; 16.38 MiB free; 1.51 GiB reserved in total by "
        "PyTorch",
        "shortage",  # the closing parenthesis was lost in the paste
    ),
    RealCase(
        _GH + "rshaojimmy/MADDoG/issues/11",
        "RuntimeError: CUDA out of memory. Tried to allocate 2.87 GiB (GPU 0; 14.76 GiB total "
        "capacity; 8.77 GiB already allocated; 19.75 MiB free; 13.71 GiB reserved in total by "
        "PyTorch)",
        "fragmentation",
    ),
    RealCase(
        _GH + "open-mmlab/mmsegmentation/issues/944",
        "RuntimeError: CUDA out of memory. Tried to allocate 1006.00 MiB (GPU 0; 10.91 GiB total "
        "capacity; 9.18 GiB already allocated; 569.81 MiB free; 9.49 GiB reserved in total by "
        "PyTorch)",
        "shortage",
    ),
    RealCase(
        _GH + "2KangHo/vdsr_pytorch/issues/2",
        "RuntimeError: CUDA out of memory. Tried to allocate 512.00 MiB (GPU 0; 15.90 GiB total "
        "capacity; 13.13 GiB already allocated; 415.88 MiB free; 14.80 GiB reserved in total by "
        "PyTorch)",
        "fragmentation",
    ),
    RealCase(
        _GH + "kchengiva/Shift-GCN/issues/34",
        "RuntimeError: CUDA out of memory. Tried to allocate 236.00 MiB (GPU 0; 15.78 GiB total "
        "capacity; 14.25 GiB already allocated; 183.50 MiB free; 14.34 GiB reserved in total by "
        "PyTorch)",
        "shortage",  # a 0.6% cache
    ),
    RealCase(
        _GH + "CompVis/taming-transformers/issues/194",
        "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.39 GiB (GPU 0; "
        "6.00 GiB total capacity; 4.04 GiB already allocated; 478.00 MiB free; 4.15 GiB reserved"
        " in total by PyTorch)" + _TAIL_20,
        "shortage",
    ),
    RealCase(
        _GH + "gjy3035/NWPU-Crowd-Sample-Code/issues/27",
        "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 38.00 MiB (GPU 0; "
        "4.00 GiB total capacity; 3.41 GiB already allocated; 0 bytes free; 3.44 GiB reserved in"
        " total by PyTorch)" + _TAIL_20,
        "shortage",
    ),
    RealCase(
        _GH + "SYLan2019/DSTAGNN/issues/4",
        "error:\n CUDA out of memory. Tried to allocate 12.00 MiB (GPU 0; 2.00 GiB total capacity;"
        " 1.68 GiB already allocated; 0 bytes free; 1.71 GiB reserved in total by PyTorch)"
        + _TAIL_20,
        "fragmentation",  # a 30.72 MiB cache >= the 12.00 MiB request
    ),
    RealCase(
        _GH + "ToTheBeginning/PuLID/issues/13",
        "`torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 22.00 MiB (GPU 0; "
        "12.00 GiB total capacity; 10.89 GiB already allocated; 0 bytes free; 11.31 GiB reserved"
        " in total by PyTorch)" + _TAIL_20 + "`",
        "fragmentation",  # a 430.08 MiB cache (3.7%) >= the 22.00 MiB request
    ),
    RealCase(
        _GH + "eps696/aphantasia/issues/22",
        "RuntimeError: CUDA out of memory. Tried to allocate 60.00 MiB (GPU 0; 6.00 GiB total "
        "capacity; 4.11 GiB already allocated; 34.82 MiB free; 4.42 GiB reserved in total by "
        "PyTorch)",
        "fragmentation",  # a 7% cache, 5x the request
    ),
    RealCase(
        _GH + "zhou13/lcnn/issues/23",
        "RuntimeError: CUDA out of memory. Tried to allocate 96.00 MiB (GPU 0; 5.81 GiB total "
        "capacity; 4.66 GiB already allocated; 77.50 MiB free; 4.68 GiB reserved in total by "
        "PyTorch) TensorBoard caught SIGTERM; exiting...",
        "shortage",
    ),
    RealCase(
        _GH + "xinzhanguo/hellollm/issues/9",
        "RuntimeError: CUDA out of memory. Tried to allocate 148.00 MiB (GPU 0; 2.00 GiB total "
        "capacity; 959.93 MiB already allocated; 96.16 MiB free; 1.03 GiB reserved in total by "
        "PyTorch)",
        "fragmentation",  # a 9% cache with the free memory covers 148 MiB
    ),
    RealCase(
        _GH + "tatsu-lab/stanford_alpaca/issues/76",
        '"torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 388.00 MiB (GPU 2; '
        "23.70 GiB total capacity; 21.91 GiB already allocated; 315.69 MiB free; 22.09 GiB "
        'reserved in total by PyTorch)' + _TAIL_20 + '".',
        "shortage",
    ),
    RealCase(
        _GH + "AetherCortex/Llama-X/issues/12",
        "RuntimeError: CUDA out of memory. Tried to allocate 688.00 MiB (GPU 6; 31.75 GiB total "
        "capacity; 29.87 GiB already allocated; 41.94 MiB free; 30.29 GiB reserved in total by "
        "PyTorch)" + _TAIL_20,
        "shortage",
    ),
    RealCase(
        _GH + "tatsu-lab/stanford_alpaca/issues/189",
        "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 774.00 MiB (GPU 0; "
        "80.00 GiB total capacity; 71.96 GiB already allocated; 791.50 MiB free; 72.18 GiB "
        "reserved in total by PyTorch)" + _TAIL_20,
        "outside_pytorch",  # 7 GiB outside the allocator (FSDP's NCCL buffers)
    ),
    RealCase(
        _GH + "hiyouga/LlamaFactory/issues/257",
        "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 448.00 MiB (GPU 7; "
        "79.32 GiB total capacity; 78.58 GiB already allocated; 259.56 MiB free; 78.58 GiB "
        "reserved in total by PyTorch)" + _TAIL_20,
        "shortage",
    ),
    RealCase(
        _GH + "easydiffusion/easydiffusion/issues/104",
        "`RuntimeError: CUDA out of memory. Tried to allocate 64.00 MiB (GPU 0; 4.00 GiB total "
        "capacity; 3.35 GiB already allocated; 0 bytes free; 3.41 GiB reserved in total by "
        "PyTorch)" + _TAIL_20 + "`",
        "shortage",
    ),
    RealCase(
        _GH + "AUTOMATIC1111/stable-diffusion-webui/issues/5546",
        "runtime error: CUDA out of memory. Tried to allocate 648.00 MiB (GPU 0; 6.00 GiB total "
        "capacity; 4.66 GiB already allocated; 0 bytes free; 4.70 GiB reserved in total by "
        "PyTorch)" + _TAIL_20,
        "shortage",
    ),
    RealCase(
        _GH + "rbbrdckybk/ai-art-generator/issues/19",
        "RuntimeError: CUDA out of memory. Tried to allocate 36.00 MiB (GPU 0; 4.00 GiB total "
        "capacity; 3.45 GiB already allocated; 0 bytes free; 3.47 GiB reserved in total by "
        "PyTorch)" + _TAIL_20,
        "shortage",
    ),
    RealCase(
        _GH + "AUTOMATIC1111/stable-diffusion-webui/issues/3203",
        "RuntimeError: CUDA out of memory.\n\nTried to allocate 12.00 GiB (GPU 0; 24.00 GiB total"
        " capacity; 8.33 GiB already allocated; 8.65 GiB free; 12.89 GiB reserved in total by "
        "PyTorch)\n\nIf reserved memory is >> allocated memory try setting max_split_size_mb to "
        "avoid fragmentation.",
        "fragmentation",  # a 4.56 GiB cache with 8.65 GiB free covers 12 GiB
    ),
    RealCase(
        _GH + "CompVis/stable-diffusion/issues/86",
        "RuntimeError: CUDA out of memory. Tried to allocate 1.50 GiB (GPU 0; 10.92 GiB total "
        "capacity; 8.62 GiB already allocated; 1.39 GiB free; 8.81 GiB reserved in total by "
        "PyTorch)",
        "shortage",
    ),
    RealCase(
        _GH + "AUTOMATIC1111/stable-diffusion-webui/issues/3527",
        "`RuntimeError: CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 6.00 GiB total "
        "capacity; 5.26 GiB already allocated; 0 bytes free; 5.33 GiB reserved in total by "
        "PyTorch)" + _TAIL_20 + " `",
        "fragmentation",  # a 71.68 MiB cache >= the 20.00 MiB request
    ),
    RealCase(
        _GH + "cq535454518/Whisper-Whisperx-GUI/issues/1",
        "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; "
        "3.00 GiB total capacity; 2.10 GiB already allocated; 14.36 MiB free; 2.10 GiB reserved "
        "in total by PyTorch)" + _TAIL_20,
        "shortage",
    ),
    RealCase(
        _GH + "WongKinYiu/yolov7/issues/604",
        "CUDA out of memory. Tried to allocate 40.00 MiB (GPU 0; 6.00 GiB total capacity; 4.22 "
        "GiB already allocated; 0 bytes free; 4.30 GiB reserved in total by PyTorch)",
        "fragmentation",  # an 81.92 MiB cache >= the 40.00 MiB request
    ),
    RealCase(
        _GH + "ultralytics/yolov5/issues/285",
        "RuntimeError: CUDA out of memory. Tried to allocate 2.60 GiB (GPU 0; 3.81 GiB total "
        "capacity; 129.38 MiB already allocated; 2.12 GiB free; 410.00 MiB reserved in total by "
        "PyTorch)",
        "shortage",  # 2.6 GiB of a 4 GiB card beside the context; the cache + free fall short
    ),
    RealCase(
        _GH + "Okery/YOLOv5-PyTorch/issues/5",
        "RuntimeError: CUDA out of memory. Tried to allocate 2.00 MiB (GPU 0; 8.00 GiB total "
        "capacity; 4.78 GiB already allocated; 0 bytes free; 6.10 GiB reserved in total by "
        "PyTorch)",
        "fragmentation",
    ),
    RealCase(
        _GH + "ultralytics/yolov5/issues/1094",
        "RuntimeError: CUDA out of memory. Tried to allocate 600.00 MiB (GPU 0; 2.00 GiB total "
        "capacity; 917.58 MiB already allocated; 424.44 MiB free; 932.00 MiB reserved in total "
        "by PyTorch)",
        "shortage",
    ),
    # --- <= 1.4 ("N cached") -------------------------------------------------------------------
    RealCase(
        _GH + "ryujaehun/pytorch-gpu-benchmark/issues/1",
        "RuntimeError: CUDA out of memory. Tried to allocate 32.00 MiB (GPU 0; 7.79 GiB total "
        "capacity; 6.64 GiB already allocated; 21.00 MiB free; 150.86 MiB cached)",
        "fragmentation",  # "cached" is the cache here: 150.86 MiB >= the 32.00 MiB request
    ),
    RealCase(
        _GH + "shllln/GenerativeGraph/issues/5",
        "RuntimeError: CUDA out of memory. Tried to allocate 1024.00 KiB (GPU 0; 11.17 GiB total"
        " capacity; 10.90 GiB already allocated; 576.00 KiB free; 30.96 MiB cached)",
        "fragmentation",  # a 30.96 MiB cache >= the 1.00 MiB request
    ),
    RealCase(
        _GH + "Tramac/awesome-semantic-segmentation-pytorch/issues/188",
        "RuntimeError: CUDA out of memory. Tried to allocate 74.00 MiB (GPU 0; 1.96 GiB total "
        "capacity; 1.46 GiB already allocated; 71.50 MiB free; 38.53 MiB cached)",
        "shortage",
    ),
    RealCase(
        _GH + "mayorx/rcf-edge-detection/issues/4",
        "RuntimeError: CUDA out of memory. Tried to allocate 24.00 MiB (GPU 0; 3.95 GiB total "
        "capacity; 3.46 GiB already allocated; 1.06 MiB free; 60.00 KiB cached)",
        "shortage",
    ),
    RealCase(
        _GH + "traveller59/second.pytorch/issues/143",
        "RuntimeError: CUDA out of memory. Tried to allocate 550.00 MiB (GPU 0; 10.73 GiB total "
        "capacity; 7.96 GiB already allocated; 170.50 MiB free; 1.36 GiB cached)",
        "fragmentation",  # a 1.36 GiB cache, 2.5x the request
    ),
    RealCase(
        _GH + "Morizeyao/GPT2-Chinese/issues/104",
        "RuntimeError: CUDA out of memory. Tried to allocate 384.00 MiB (GPU 2; 10.73 GiB total "
        "capacity; 9.59 GiB already allocated; 290.56 MiB free; 25.84 MiB cached)",
        "shortage",
    ),
    # --- added for issue 35 item 6 (the same search, other issues) ------------------------------
    RealCase(
        _GH + "qingze-bai/VSmTrans/issues/3",
        "    return Variable._execution_engine.run_backward(  # Calls into the C++ engine to run "
        "the backward pass\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate 226.00 "
        "MiB. GPU 0 has a total capacity of 15.70 GiB of which 210.38 MiB is free. Including "
        "non-PyTorch memory, this process has 15.48 GiB memory in use. Of the allocated memory "
        "14.81 GiB is allocated by PyTorch, and 336.73 MiB is reserved by PyTorch but "
        "unallocated. If reserved but unallocated memory is large try setting "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See "
        "documentation for Memory Management",
        "fragmentation",  # a 336.73 MiB cache >= the 226.00 MiB request
    ),
    RealCase(
        _GH + "studio-dots-ai/dots.ocr/issues/196",
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 74.16 GiB. GPU 0 has a "
        "total capacity of 44.40 GiB of which 29.89 GiB is free. Process 2684311 has 14.51 GiB "
        "memory in use. Of the allocated memory 13.44 GiB is allocated by PyTorch, and 738.96 MiB "
        "is reserved by PyTorch but unallocated." + _TAIL_22,
        "request_exceeds_device",
    ),
    RealCase(
        _GH + "pytorch/pytorch/issues/35901",
        "CUDA out of memory. Tried to allocate 10.84 GiB (GPU 0; 23.65 GiB total capacity; 1.06 "
        "GiB already allocated; 10.26 GiB free; 12.53 GiB reserved in total by PyTorch)",
        "fragmentation",  # an 11.47 GiB cache >= the 10.84 GiB request
    ),
    RealCase(
        _GH + "pytorch/pytorch/issues/37250",
        "RuntimeError: CUDA out of memory. Tried to allocate 5.74 GiB (GPU 0; 5.50 GiB total "
        "capacity; 588.00 MiB already allocated; 4.13 GiB free; 588.00 MiB reserved in total by "
        "PyTorch)" + _TAIL_20,
        "request_exceeds_device",
    ),
    # --- backend:cudaMallocAsync ------------------------------------------------------------------
    RealCase(
        _GH + "Comfy-Org/ComfyUI/issues/12360",
        "Allocation on device 0 would exceed allowed memory. (out of memory)\nCurrently "
        "allocated : 14.81 GiB\nRequested : 320.00 MiB\nDevice limit : 15.92 GiB\nFree "
        "(according to CUDA): 0 bytes\nPyTorch limit (set by user-supplied memory fraction)\n: "
        "17179869184.00 GiB\nThis error means you ran out of memory on your GPU.",
        "shortage",
    ),
)
