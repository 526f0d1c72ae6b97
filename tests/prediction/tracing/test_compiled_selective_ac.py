"""Compiled blocks under selective-op checkpointing inside FSDP2: the saved RNG state is host.

A compiled block whose selective checkpoint recomputes a seeded op (dropout) saves the RNG state
for the recompute (torch/_functorch/partitioners.py ``functionalize_rng_ops``); on the fake
group's ``cpu`` device that is ``torch.get_rng_state()``, a real 5056-byte host tensor, which the
recorder's pack hook must save without ``FakeTensorMode`` refusing it and without counting it
as device memory (``fake_storages.detach_saved``).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from oomkit.core.target import Target
from oomkit.prediction.models.compiled_blocks import with_torchtitan_dynamo_config
from oomkit.prediction.models.selective_ac import selective_op_context
from oomkit.prediction.tracing import recorder
from oomkit.prediction.tracing.distributed import trace_distributed_step
from oomkit.prediction.tracing.fake_storages import (
    detach_saved,
    fake_tensor_storage,
    stands_for_cuda,
)

# One block: x + down(dropout(gelu(up(x)))), 64 -> 256 -> 64, fp32, no biases (so the
# projections are aten.mm, which the policy saves every second of), on 8 x 32 tokens.
TOKENS, HIDDEN, WIDE = 8 * 32, 64, 256
WIDE_BYTES, HIDDEN_BYTES = TOKENS * WIDE * 4, TOKENS * HIDDEN * 4  # 262144, 65536
MASK_BYTES = TOKENS * WIDE  # dropout's bool mask: 65536
# The CPU generator's state (mt19937: torch.get_rng_state().numel()).
CPU_RNG_STATE_BYTES = 5056


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(HIDDEN, WIDE, bias=False)
        self.down = torch.nn.Linear(WIDE, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.nn.functional.dropout(torch.nn.functional.gelu(self.up(x)), p=0.1)
        return x + self.down(hidden)


def _builder(compiled: bool):
    def build(mesh):
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            checkpoint_wrapper,
        )
        from torch.distributed.fsdp import fully_shard

        # torchtitan's order: AC (selective op, preserve_rng_state=False), compile, FSDP2.
        model = torch.nn.Sequential(
            *(
                checkpoint_wrapper(
                    _Block(), context_fn=selective_op_context, preserve_rng_state=False
                )
                for _ in range(2)
            )
        )
        for block in model:
            if compiled:
                block.compile(fullgraph=True)
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.AdamW(model.parameters())
        batch = torch.randn(8, 32, HIDDEN)

        def step():
            model(batch).sum().backward()
            optimizer.step()
            optimizer.zero_grad()

        return with_torchtitan_dynamo_config(step), (model, optimizer, batch)

    return build


@pytest.fixture(scope="module")
def recordings():
    """Eager and compiled rank 0 of FSDP2 over 2 ranks, two steps each, and the real tensors
    the compiled run's pack hook saved."""
    real_saved: list[tuple[int, torch.dtype]] = []

    def spy(tensor: torch.Tensor) -> torch.Tensor:
        if type(tensor) is torch.Tensor and tensor.device.type != "meta":
            real_saved.append((tensor.numel() * tensor.element_size(), tensor.dtype))
        return detach_saved(tensor)

    eager = trace_distributed_step(_builder(False), world_size=2, steps=2)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(recorder, "detach_saved", spy)
        compiled = trace_distributed_step(_builder(True), world_size=2, steps=2, compile=True)
    assert not dist.is_initialized()
    return eager, compiled, real_saved


def test_each_compiled_checkpoint_saves_the_host_rng_state(recordings):
    """2 blocks x 2 steps: 4 compiled forwards each saved the CPU generator's real state."""
    _, compiled, real_saved = recordings
    assert real_saved == [(CPU_RNG_STATE_BYTES, torch.uint8)] * 4
    assert "compiled code was entered 4 time(s)" in " ".join(compiled.warnings)


def test_no_host_rng_state_is_counted_on_the_device(recordings):
    """No allocation of the RNG state's size, and none that the eager run lacks but for the
    compiled backward's own buffers (listed by size below)."""
    eager, compiled, _ = recordings
    sizes = {event.size for event in compiled.events if event.action == "alloc"}
    assert CPU_RNG_STATE_BYTES not in sizes
    assert sizes <= {event.size for event in eager.events if event.action == "alloc"}


def test_the_rng_wrapped_op_s_output_is_recorded_when_made(recordings):
    """The recomputed seeded op (dropout's aten.rand) runs inside run_and_save_rng_state in the
    compiled forward and run_with_rng_state in the compiled backward, Inductor fallback kernels:
    its 262144-byte output is allocated there, once per block in each, and no storage shows up
    first in use."""
    _, compiled, _ = recordings
    rands = [
        event.size
        for event in compiled.step_events(1)
        if event.action == "alloc" and dict(event.tags).get("op") == "aten.rand.default"
    ]
    assert rands == [WIDE_BYTES] * 4
    assert not any("existed before tracing" in warning for warning in compiled.warnings)


def test_peaks_compiled_and_eager_and_why_they_differ(recordings):
    """Both peak in the second step's backward of block 1, after its all-gather, with the same
    saved activations (589824: each block's saved up-projection mm output, and the input).

    Eager holds there the recomputed dropout output (262144) and its bool mask (65536), down's
    weight gradient (65536) and down's grad input (262144). Compiled holds the contiguous copy
    of the incoming gradient (65536, AOTAutograd's backward prologue:
    torch/_functorch/_aot_autograd/runtime_wrappers.py coerce_to_expected_memory_format), the
    recompute of dropout(gelu(up)) as one fused kernel's output (262144: Inductor regenerates
    the mask from the saved RNG state inside the kernel, no mask buffer) and down's weight
    gradient (65536); it computes the grad input after freeing the fused output. So compiled =
    eager - 262144 allocated; the segments (reserved) are the same."""
    from oomkit.prediction.predictor import predict_recording

    eager, compiled, _ = recordings
    target = Target.resolve("h100")
    eager_peak = predict_recording(eager, target=target)
    compiled_peak = predict_recording(compiled, target=target)
    held_eager = WIDE_BYTES + MASK_BYTES + HIDDEN_BYTES + WIDE_BYTES
    held_compiled = HIDDEN_BYTES + WIDE_BYTES + HIDDEN_BYTES
    assert held_eager - held_compiled == WIDE_BYTES
    assert eager_peak.peak_allocated_bytes - compiled_peak.peak_allocated_bytes == WIDE_BYTES
    assert eager_peak.peak_allocated_bytes == 69075968
    assert compiled_peak.peak_allocated_bytes == 69075968 - WIDE_BYTES
    assert eager_peak.peak_reserved_bytes == compiled_peak.peak_reserved_bytes == 73400320
    at_eager = dict(eager_peak.peak_allocated_at.by_category_bytes)
    at_compiled = dict(compiled_peak.peak_allocated_at.by_category_bytes)
    assert at_eager["activation"] == at_compiled["activation"] == 589824
    # The loss's two 4-byte scalars (512-byte blocks) are temporaries in both.
    assert at_eager.pop("temporary") == held_eager - HIDDEN_BYTES + 1024
    assert at_eager.pop("gradient") == HIDDEN_BYTES
    assert at_compiled.pop("temporary") == held_compiled + 1024
    assert at_compiled == at_eager


def test_detach_saved_makes_a_real_tensor_a_host_fake_under_fake_mode():
    """A real tensor saved under FakeTensorMode comes back fake, of its shape and dtype, with
    no device storage; fake, meta and real tensors outside a fake mode are plainly detached."""
    state = torch.get_rng_state()
    with FakeTensorMode() as mode:
        saved = detach_saved(state)
        fake = mode.from_tensor(torch.ones(4))
        alias = detach_saved(fake)
    assert isinstance(saved, FakeTensor)
    assert (saved.shape, saved.dtype) == (state.shape, torch.uint8)
    assert fake_tensor_storage(saved, "meta") is None and not stands_for_cuda(saved)
    assert alias.untyped_storage()._cdata == fake.untyped_storage()._cdata
    assert stands_for_cuda(alias)
    meta = torch.ones(3, device="meta", requires_grad=True) * 2
    assert detach_saved(meta).grad_fn is None and detach_saved(meta).device.type == "meta"
    real = detach_saved(state)
    assert type(real) is torch.Tensor and torch.equal(real, state)
