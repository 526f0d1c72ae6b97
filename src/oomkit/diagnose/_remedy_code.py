"""What a model remedy shows (its code; a measured one's why), estimated or measured alike.

The same snippet for an estimate from a trace's categories (``_model_remedies``) and for a
measurement by re-predicting (``remedy_measurement``).

Its own module so that an estimate does not import the re-prediction machinery (the target,
the workload record, the predictor): ``oomkit explain SNAPSHOT`` stays light (issue 41 item 4).
"""

from __future__ import annotations

import shlex
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from oomkit.diagnose.oom_traceback import Trainer

__all__ = [
    "ACCUMULATION_LOOP_CODE",
    "CHECKPOINT_CODE",
    "FP16_CODE",
    "MEASURED_WHY",
    "MIXED_CODE",
    "PURE_BF16_CODE",
    "SGD_CODE",
    "setting_code",
    "workload_code",
]


def setting_code(setting: str, script: str | None = None) -> str:
    """Copy-paste code that applies an allocator setting, both ways PyTorch reads one: the
    environment variable, read once at the first CUDA allocation (c10/cuda/CUDAAllocatorConfig),
    and ``torch.cuda.memory._set_allocator_settings`` at run time.

    Args:
        setting: the ``PYTORCH_CUDA_ALLOC_CONF`` value.
        script: the script the OOM's traceback shows Python running
            (``OomLocation.script``); None: a placeholder, ``train.py``.
    """
    command = "python " + ("train.py" if script is None else shlex.quote(script))
    return (
        "# before CUDA initialises (read once, at the first CUDA allocation):\n"
        f"PYTORCH_CUDA_ALLOC_CONF={setting} {command}\n"
        "# or at run time, in the script:\n"
        f'torch.cuda.memory._set_allocator_settings("{setting}")'
    )


# What uses less memory per step, said in the words of the loop that ran it: the trainer's own
# arguments (transformers.TrainingArguments' fields as its command line spells them; Lightning's
# Trainer arguments), else plain PyTorch.
_LESS_PER_STEP = {
    None: (
        "# a smaller batch with gradient accumulation (same global batch), activation checkpointing\n"
        "# (torch.utils.checkpoint), bf16/fp16 mixed precision (torch.autocast), an 8-bit optimizer"
    ),
    "transformers": (
        "# the Trainer's arguments: a smaller --per_device_train_batch_size with a larger\n"
        "# --gradient_accumulation_steps (same global batch), --gradient_checkpointing, --bf16,\n"
        "# --optim adamw_bnb_8bit (bitsandbytes)"
    ),
    "lightning": (
        "# the loader's batch_size halved with Trainer(accumulate_grad_batches=2) (same global\n"
        '# batch), Trainer(precision="bf16-mixed"), activation checkpointing in the module\n'
        "# (torch.utils.checkpoint), an 8-bit optimizer in configure_optimizers"
    ),
}


def workload_code(script: str | None, trainer: Trainer | None, gpu: str | None) -> str:
    """What lowers a step's memory, and the oomkit commands that measure it before a run.

    Args:
        script: the script the OOM's traceback shows Python running (``OomLocation.script``);
            None: the commands are named, not written out.
        trainer: the trainer whose loop ran the step (``OomLocation.trainer``).
        gpu: the ``--gpu`` value of the OOM's device (a catalog name or a size); None: unknown.
    """
    ways = _LESS_PER_STEP[trainer]
    if script is None:
        return ways + ";\n# `oomkit predict` or `oomkit fit` measure each on your step"
    on = f"{shlex.quote(script)}" + ("" if gpu is None else f" --gpu {shlex.quote(gpu)}")
    # fit reads the batch from the script's arguments (scenario/script_batch.py): the Trainer's
    # is --per_device_train_batch_size, named for a run whose ARGS leave it at its default.
    batch_arg = " --batch-arg --per_device_train_batch_size" if trainer == "transformers" else ""
    return (
        f"{ways};\n"
        "# measure each before a run (ARGS: the arguments the run was given):\n"
        f"oomkit predict {on} -- ARGS\n"
        f"oomkit fit {on}{batch_arg} -- ARGS  # the largest batch that fits"
    )


# The why of every measured remedy, first in its sentence.
MEASURED_WHY = "measured by re-predicting the step with the change applied"

# A training loop over micro-batches of a loader, one optimizer step per accumulation_steps
# (the lines that set accumulation_steps and the loader come before it).
ACCUMULATION_LOOP_CODE = (
    "for i, (inputs, targets) in enumerate(loader):\n"
    "    loss = loss_fn(model(inputs), targets) / accumulation_steps\n"
    "    loss.backward()\n"
    "    if (i + 1) % accumulation_steps == 0:\n"
    "        optimizer.step()\n"
    "        optimizer.zero_grad(set_to_none=True)"
)
MIXED_CODE = (
    "# bf16 needs no GradScaler\n"
    'with torch.autocast("cuda", dtype=torch.bfloat16):\n'
    "    loss = loss_fn(model(inputs), targets)\n"
    "loss.backward()\n"
    "optimizer.step()"
)
FP16_CODE = (
    "scaler = torch.amp.GradScaler()  # fp16 gradients underflow without loss scaling\n"
    'with torch.autocast("cuda", dtype=torch.float16):\n'
    "    loss = loss_fn(model(inputs), targets)\n"
    "scaler.scale(loss).backward()\n"
    "scaler.step(optimizer)\n"
    "scaler.update()"
)
PURE_BF16_CODE = (
    "model = model.to(torch.bfloat16)  # weights, gradients and optimizer states in bf16\n"
    "# Hugging Face: AutoModelForCausalLM.from_pretrained(name, torch_dtype=torch.bfloat16)\n"
    "optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)"
)
CHECKPOINT_CODE = (
    "from torch.utils.checkpoint import checkpoint\n"
    "# in the model's forward, around each block:\n"
    "for block in self.blocks:\n"
    "    x = checkpoint(block, x, use_reentrant=False)\n"
    "# Hugging Face models: model.gradient_checkpointing_enable()"
)
SGD_CODE = (
    "optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)  # one state\n"
    "# or keep Adam's behaviour with less state (hints, not measured):\n"
    "#   Adafactor (factored second moment): torch.optim.Adafactor in PyTorch 2.5+\n"
    "#   8-bit states: bitsandbytes.optim.AdamW8bit(model.parameters(), lr=1e-4)"
)
