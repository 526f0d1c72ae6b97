"""``sum`` and ``mean`` as CUDA runs them (emulations/reductions.py): the output, then the staging
buffer and semaphores of a reduction split across thread blocks, freed at once; the input's cast
copy where the kernel reads another dtype; a site a batch search can synthesize."""

from __future__ import annotations

import pytest

from oomkit.core.gpus import GpuSpec
from oomkit.core.target import Target
from oomkit.plan.trace_interpolation import TraceInterpolator, _normalize, same_recording
from oomkit.prediction.tracing import trace_step
from oomkit.prediction.tracing.emulation_sites import REDUCTION_SITE

torch = pytest.importorskip("torch")

H200 = Target.resolve("h200")


def _events(step, *inputs, target=H200):
    recording = trace_step(step, torch.nn.Identity(), *inputs, target=target)
    start = recording.step_starts[0]
    return recording, [
        (e.action, e.size, e.tag("emulated")) for e in recording.events[start:]
        if e.action in ("alloc", "free_completed")
    ]


def _meta(*sizes, dtype=torch.float32):
    return torch.empty(*sizes, device="meta", dtype=dtype)


def test_a_bias_gradients_sum_stages_after_its_output_and_frees_at_once():
    """GPT-2's c_proj bias gradient as the H200 ran it: 3,072 bytes of output, 12 MiB of
    staging, 24 bytes of semaphores, semaphores freed first (C++ destroys them first)."""
    _, events = _events(lambda model, g: g.sum(0), _meta(2048, 768))
    assert events[:5] == [
        ("alloc", 3072, None),
        ("alloc", 12_582_912, "reduction_staging"),
        ("alloc", 24, "reduction_semaphores"),
        ("free_completed", 24, None),
        ("free_completed", 12_582_912, None),
    ]


def test_mean_of_bf16_accumulates_in_float_and_a_small_reduction_stages_nothing():
    _, events = _events(lambda model, g: g.mean(dim=0), _meta(2048, 768, dtype=torch.bfloat16))
    assert [e[1] for e in events[:3]] == [1536, 12_582_912, 24]
    _, events = _events(lambda model, g: g.sum(0), _meta(512, 2048))
    assert [e for e in events if e[2]] == []  # one block per output: no staging


def test_a_bool_mask_sum_copies_the_mask_to_int64_first():
    """make_reduction_from_out_ty: a bool input summed into int64 is read as int64, a copy of
    8 bytes per element made after the output and freed after the kernel."""
    _, events = _events(lambda model, m: m.sum(), _meta(8, 128, dtype=torch.bool))
    assert events[:3] == [
        ("alloc", 8, None),
        ("alloc", 8 * 1024, "reduction_cast"),
        ("free_completed", 8 * 1024, None),
    ]


def test_a_sum_on_the_host_or_of_nothing_records_only_its_output():
    _, events = _events(lambda model, g: g.sum(0) + g.cpu().sum(), _meta(2, 3))
    assert not [e for e in events if e[2]]
    _, events = _events(lambda model, g: g.sum(0), _meta(0, 768))
    assert not [e for e in events if e[2]]


def test_the_staging_follows_the_target_gpus_sms():
    """RTX 4090: 128 SMs of 1,536 threads; a size given as bytes: an H100 SXM's 132 x 2,048."""
    gradient = _meta(8192, 3072)
    staging = {}
    for name, target in (
        ("rtx4090", Target.resolve("rtx4090")),
        ("24GiB", Target(gpu=GpuSpec("24 GiB", 24 * 2**30, 2**29))),
    ):
        _, events = _events(lambda model, g: g.sum(0), gradient, target=target)
        staging[name] = next(e[1] for e in events if e[2] == "reduction_staging")
    assert staging == {"rtx4090": 4 * 3072 * 64 * 128, "24GiB": 4 * 3072 * 88 * 128}


def _step(tokens):
    def step(model, x):
        return (x * 2).sum(0)

    recording, _ = _events(step, _meta(tokens, 768))
    return recording


def test_each_reduction_is_a_site_and_its_staging_is_synthesized_across_the_threshold():
    """At 256 tokens the bias-like sum stages nothing; from 1,024 it does, growing with the
    tokens but not affinely. Each call is a site: learned from 256 and 512 tokens (no staging),
    the recordings at 1,024 and 4,096 come out with their staging, event for event."""
    recordings = {t: _step(t) for t in (256, 512, 1024, 4096)}
    assert [s.kind for s in recordings[1024].sites] == [REDUCTION_SITE]
    assert all(_normalize(r).stripped for r in recordings.values())
    assert not [e for e in recordings[512].events if e.tag("emulated")]
    assert [e.size for e in recordings[4096].events if e.tag("emulated")] == [25_165_824, 24]
    interpolator = TraceInterpolator(points=2)
    interpolator.add(256, recordings[256])
    interpolator.add(512, recordings[512])
    for tokens in (1024, 4096):
        assert same_recording(interpolator.synthesize(tokens), recordings[tokens])


def test_past_32_bit_indexing_each_launch_stages_and_frees_before_the_next():
    """A 16 GiB [65536, 65536] fp32 summed over rows runs as 8 launches (with_32bit_indexing):
    each asks for its staging and semaphores and drops them before the next; no site is noted
    (a site's temporaries are held together). Each launch: 8,192 rows, 512 block columns (2 KiB
    of semaphores), 2,048 values per thread, so max(min(2112 / 512, 2048 / 16), 2048 / 256) =
    8 blocks per column: 4 x 65536 x 8 x (32 x 4) bytes of staging."""
    recording, events = _events(lambda model, g: g.sum(0), _meta(65536, 65536))
    staged = [e for e in events if e[2] is not None or e[0] == "free_completed"]
    launch = [("alloc", 4 * 65536 * 8 * 128, "reduction_staging"),
              ("alloc", 4 * 512, "reduction_semaphores"),
              ("free_completed", 4 * 512, None),
              ("free_completed", 4 * 65536 * 8 * 128, None)]
    assert staged[:32] == launch * 8
    assert [s.kind for s in recording.sites] == []


def test_a_convolutions_bias_gradient_stages_like_a_sum():
    """Convolution.cpp convolution_backward: cuDNN computes no bias gradient, so it is
    grad_output.sum over (0, 2, 3) after the weight gradient. ViT's patch embedding on an H200:
    a [8, 768, 14, 14] gradient laid out channels last (the permute after the convolution), 25
    blocks per column: 9,830,400 bytes of staging and 24 of semaphores (the GPU's trace has the
    semaphores, one a step). Before the weight gradient, ConvShared.cpp's
    grad_output.to(input.suggest_memory_format()) copies that gradient to the images' plain
    layout (the GPU's trace: one such copy a step), dropped when cuDNN's backward returns."""
    weight = torch.empty(768, 3, 16, 16, device="meta", requires_grad=True)
    bias = torch.empty(768, device="meta", requires_grad=True)
    images = torch.empty(8, 3, 224, 224, device="meta")

    def patches(model, images, weight, bias):
        out = torch.nn.functional.conv2d(images, weight, bias, stride=16)
        tokens = out.reshape(8, 768, 196).permute(0, 2, 1).contiguous()
        (tokens * tokens).sum().backward()  # a gradient laid out as the tokens are

    _, events = _events(patches, images, weight, bias)
    at = next(i for i, e in enumerate(events) if e[1] == 9_830_400)
    assert events[at - 4:at + 4] == [
        ("alloc", 8 * 768 * 196 * 4, "cudnn_layout_copy"),
        ("alloc", 768 * 3 * 16 * 16 * 4, None),
        ("free_completed", 8 * 768 * 196 * 4, None),
        ("alloc", 768 * 4, None),
        ("alloc", 9_830_400, "reduction_staging"),
        ("alloc", 24, "reduction_semaphores"),
        ("free_completed", 24, None),
        ("free_completed", 9_830_400, None),
    ]


def test_amax_and_amin_accumulate_in_the_input_type():
    """max_values_kernel_cuda_impl: gpu_reduce_kernel<scalar_t, scalar_t> with acc_t =
    scalar_t, so a bfloat16 amax over the tokens stages half what the bfloat16 mean (float
    accumulator) of the same gradient stages, and an fp32 amax or amin as much as an fp32 sum;
    each is a site a batch search synthesizes."""
    recording, events = _events(lambda model, g: g.amax(0), _meta(2048, 768, dtype=torch.bfloat16))
    assert [e[1] for e in events[:3]] == [1536, 12_582_912 // 2, 24]
    assert [s.kind for s in recording.sites] == [REDUCTION_SITE] and _normalize(recording).stripped
    for reduce in (lambda model, g: g.amax(0), lambda model, g: torch.amin(g, 0, keepdim=True)):
        _, events = _events(reduce, _meta(2048, 768))
        assert [e[1] for e in events[:3]] == [3072, 12_582_912, 24]


def test_float8_rowwise_column_amax_of_a_gradient_stages_tens_of_mib():
    """torchao's rowwise scaling of a [16384, 14336] bf16 gradient along the tokens (amax over
    dim 0): 19 blocks per column, 2 x 14,336 x 19 x (32 x 4) bytes of staging on an H200."""
    _, events = _events(lambda model, g: torch.amax(g, dim=0, keepdim=True),
                        _meta(16384, 14336, dtype=torch.bfloat16))
    assert events[:3] == [
        ("alloc", 28_672, None),
        ("alloc", 2 * 14336 * 19 * 128, "reduction_staging"),
        ("alloc", 448, "reduction_semaphores"),
    ]


def test_max_of_everything_runs_on_a_contiguous_copy_made_after_its_output():
    """TensorCompare.cpp max(self): the 0-d result, then max_all_stub on self.contiguous(): a
    transposed 4096 x 4096 fp32 input is copied (64 MiB), the whole-tensor reduction stages
    2,112 bytes, and the copy is freed last; a contiguous input is read in place."""
    _, events = _events(lambda model, g: torch.max(g.t()), _meta(4096, 4096))
    assert events[:7] == [
        ("alloc", 4, None),
        ("alloc", 67_108_864, "reduction_contiguous_copy"),
        ("alloc", 2112, "reduction_staging"),
        ("alloc", 4, "reduction_semaphores"),
        ("free_completed", 4, None),
        ("free_completed", 2112, None),
        ("free_completed", 67_108_864, None),
    ]
    _, events = _events(lambda model, g: torch.min(g), _meta(4096, 4096))
    assert [e[2] for e in events[:3]] == [None, "reduction_staging", "reduction_semaphores"]
