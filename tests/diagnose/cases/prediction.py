"""A saved prediction (the fields `oomkit explain` reads) for the prediction-input tests."""

from __future__ import annotations

MiB = 2**20
GiB = 2**30

# The fields of `oomkit predict gpt2-124m --batch 8 --gpu 4GiB --steps 2 --json` that explain
# reads (figures as that command printed them).
MESSAGE = (
    "CUDA out of memory. Tried to allocate 96.00 MiB. GPU 0 has a total capacity of 4.00 GiB of "
    "which 54.00 MiB is free. Of the allocated memory 3.50 GiB is allocated by PyTorch, and "
    "58.40 MiB is reserved by PyTorch but unallocated."
)
PREDICTION = {
    "gpu": {"name": "custom 4.00 GiB", "total_memory_bytes": 4 * GiB},
    "capacity_bytes": 4 * GiB,
    "context_overhead_bytes": 400 * MiB,
    "usable_bytes": 3875536896,
    "required_bytes": 12238979072,
    "headroom_bytes": 3875536896 - 12238979072,
    "description": "GPT-2 124M, batch 8, seq 1024, fp32, adamw, train",
    "peak_allocated_at": {
        "event_index": 385,
        "step": 0,
        "allocated_bytes": 3757680640,
        "reserved_bytes": 3818913792,
        "by_category_bytes": {
            "activation": 3225436160,
            "parameter": 498558976,
            "workspace": 33554432,
            "input": 131072,
        },
        "top_modules": [{"module": "h.0.attn.c_attn", "bytes": 109051904}],
    },
    "oom": {
        "event_index": 386,
        "step": 0,
        "op": "aten.gelu.default",
        "module": "h.7.mlp",
        "category": "activation",
        "requested_bytes": 100663296,
        "message": MESSAGE,
    },
}
