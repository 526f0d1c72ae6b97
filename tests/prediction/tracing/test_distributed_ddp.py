"""Rank 0 of DDP recorded on a fake process group: its buckets, rebuild and checks, in exact bytes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from oomkit.errors import ConfigError
from oomkit.prediction.models.data_parallel import DdpOptions
from oomkit.prediction.tracing.distributed import trace_distributed_step

# Three Linear(512, 512): a 1 MiB weight and a 2 KiB bias each, fp32.
_WEIGHT = 512 * 512 * 4
_BIAS = 512 * 4
_LAYER = _WEIGHT + _BIAS


def _build(then=None, **ddp_kwargs):
    """Three linears under DDP(**ddp_kwargs); ``then(ddp)`` runs once it is made."""

    def build(mesh):
        model = torch.nn.Sequential(*(torch.nn.Linear(512, 512) for _ in range(3)))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        batch = torch.randn(4, 512)
        wrapped = []

        def setup():
            wrapped.append(torch.nn.parallel.DistributedDataParallel(model, **ddp_kwargs))
            if then is not None:
                then(wrapped[0])

        def step():
            wrapped[0](batch).sum().backward()
            optimizer.step()
            optimizer.zero_grad()

        return step, (model, optimizer, batch), setup

    return build


def _allocs(events, category=None):
    return [
        e.size
        for e in events
        if e.action == "alloc" and (category is None or dict(e.tags)["category"] == category)
    ]


@pytest.fixture(scope="module")
def default_ddp():
    """Rank 0 of 2 replicas with DDP's defaults, two steps (the buckets are rebuilt in step 2)."""
    return trace_distributed_step(_build(), world_size=2, steps=2)


def test_constructor_allocates_one_bucket_after_its_checks_and_broadcast(default_ddp):
    """Before step 1: the shape check's device tensors, the parameter broadcast, one bucket.

    distributed.py compute_bucket_size_limits: without find_unused_parameters every parameter
    starts in one bucket (sys.maxsize); reducer.cpp verify_params_across_processes makes the
    count (int64), one gather output per rank and 2 * dims int64 of shapes and strides.
    """
    recording = default_ddp
    before = recording.events[: recording.step_starts[0]]
    assert _allocs(before, "parameter") == [_WEIGHT, _BIAS] * 3
    dims = 3 * (2 + 1)
    assert _allocs(before, "temporary") == [8, 8, 8, 8 * 2 * dims, 3 * _LAYER]
    assert _allocs(before, "ddp_bucket") == [3 * _LAYER]
    frees = [e.size for e in before if e.action == "free_completed"]
    assert sorted(frees) == sorted([8, 8, 8, 8 * 2 * dims, 3 * _LAYER])


def test_rebuild_makes_a_1_mib_first_bucket_in_gradient_order(default_ddp):
    """Step 2 rebuilds: the last layer's gradients arrive first and fill the 1 MiB first bucket.

    reducer.cpp rebuild_buckets: limits (first_bucket_bytes_cap = dist._DEFAULT_FIRST_BUCKET_BYTES,
    bucket_bytes_cap = 25 MiB); a bucket closes once it reaches its limit. sync_bucket_indices
    broadcasts the indices (7 int32) and the bucket sizes (2 int32) from device copies.
    """
    assert dist._DEFAULT_FIRST_BUCKET_BYTES == 1024 * 1024
    recording = default_ddp
    step_1 = recording.step_events(0)
    step_2 = recording.step_events(1)
    assert _allocs(step_1, "ddp_bucket") == []
    assert _allocs(step_2, "ddp_bucket") == [_LAYER, 2 * _LAYER]
    frees = [e.size for e in step_2 if e.action == "free_completed"]
    assert 3 * _LAYER in frees  # the constructor's bucket
    bucket_at = next(i for i, e in enumerate(step_2) if e.size == _LAYER and e.action == "alloc")
    assert _allocs(step_2[:bucket_at], "temporary")[-2:] == [4 * 7, 4 * 2]


def test_bucket_cap_caps_the_first_bucket_too():
    """bucket_cap_mb=1: every bucket, the first included, closes at 1 MiB (one layer each)."""
    recording = trace_distributed_step(_build(bucket_cap_mb=1), world_size=2, steps=2)
    assert _allocs(recording.step_events(1), "ddp_bucket") == [_LAYER] * 3


def test_gradient_as_bucket_view_makes_the_buckets_the_gradients():
    """gradient_as_bucket_view: the grads become bucket views; the buckets count as gradients
    and the separate gradients AccumulateGrad made in step 1 are freed in it (reducer.cpp
    mark_variable_ready_dense: ``grad = bucket_view``)."""
    recording = trace_distributed_step(
        _build(gradient_as_bucket_view=True), world_size=2, steps=2
    )
    categories = {dict(e.tags)["category"] for e in recording.events}
    assert "ddp_bucket" not in categories
    before = recording.events[: recording.step_starts[0]]
    assert _allocs(before, "gradient") == [3 * _LAYER]
    # Each separate gradient AccumulateGrad made is freed once copied into its bucket view.
    step_1 = recording.step_events(0)
    grads = [e for e in step_1 if dict(e.tags)["category"] == "gradient"]
    assert sorted(e.size for e in grads if e.action == "alloc") == sorted([_WEIGHT, _BIAS] * 3)
    assert sorted(e.size for e in grads if e.action == "free_completed") == sorted(
        [_WEIGHT, _BIAS] * 3
    )


def test_world_size_sets_the_gather_outputs_and_patches_are_restored():
    """4 ranks: four int64 gather outputs; DDP's constructor and reducer are restored after."""
    init, rebuild = torch.nn.parallel.DistributedDataParallel.__init__, dist.Reducer._rebuild_buckets
    recording = trace_distributed_step(_build(), world_size=4, steps=1)
    before = recording.events[: recording.step_starts[0]]
    assert _allocs(before, "temporary")[:5] == [8, 8, 8, 8, 8]
    assert torch.nn.parallel.DistributedDataParallel.__init__ is init
    assert dist.Reducer._rebuild_buckets is rebuild
    assert not dist.is_initialized()


@pytest.mark.parametrize("cap", [0, -1.0, True])
def test_bad_bucket_cap(cap):
    """A bucket cap that is not above 0 MiB is refused."""
    with pytest.raises(ConfigError, match="above 0 MiB"):
        DdpOptions(bucket_cap_mb=cap)


def test_hsdp_rank_holds_what_fsdp_over_its_shard_group_holds():
    """fully_shard on a 2-D (dp, fsdp) mesh is HSDP: its all-reduce across replicas is in
    place (_fsdp_collectives.py foreach_reduce), so rank 0 of 2 x 2 allocates, event for event,
    what rank 0 of FSDP2 over 2 ranks does; ranks are counted over the shard group."""

    def build(mesh):
        return _fsdp_linears(mesh, out_features=5)

    fsdp = trace_distributed_step(build, world_size=2, mesh_shape=((2,), ("fsdp",)), steps=2)
    hsdp = trace_distributed_step(build, world_size=4, mesh_shape=((2, 2), ("dp", "fsdp")), steps=2)
    assert [(e.action, e.size) for e in hsdp.events] == [(e.action, e.size) for e in fsdp.events]
    # 5 rows over the 2 shards (not 4 ranks): 3 and 2 rows.
    assert any("rows that 2 ranks do not divide" in w for w in hsdp.warnings)


class _Checkpointed(torch.nn.Module):
    """Two Linear layers recomputed in backward (non-reentrant checkpoint)."""

    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU())
        self.out = torch.nn.Linear(64, 8)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        return self.out(checkpoint(self.inner, x, use_reentrant=False))


def test_checkpoint_recomputes_under_cuda_autocast_with_fake_tensors():
    """CUDA autocast casts fake tensors that stand for CUDA memory (they report cpu), and
    checkpoint re-enters it for the recomputation (checkpoint.py _infer_device_type), else the
    recomputation runs in fp32 and checkpoint refuses what it saved."""

    def build(mesh):
        model = _Checkpointed()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        batch = torch.randn(4, 64)
        wrapped = []

        def setup():
            wrapped.append(torch.nn.parallel.DistributedDataParallel(model))

        def step():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = wrapped[0](batch).float().sum()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()

        return step, (model, optimizer, batch), setup

    recording = trace_distributed_step(build, world_size=2, steps=2)
    # autocast's cached bf16 biases and weights (the last argument is cast first): inner and out
    # in forward, inner again in the recomputation (autocast_mode.cpp cached_cast; the cache is
    # cleared when forward's region exits), all in bf16 because fake tensors that stand for CUDA
    # memory are cast.
    inner, out = [64 * 2, 64 * 64 * 2], [8 * 2, 8 * 64 * 2]
    assert _allocs(recording.step_events(1), "autocast_cache") == inner + out + inner


def test_one_replica_still_has_its_buckets():
    """World size 1 (--dp 1): DDP keeps its reducer, so the bucket and the one-output shape
    check are there as on N replicas."""
    recording = trace_distributed_step(_build(), world_size=1, steps=2)
    before = recording.events[: recording.step_starts[0]]
    assert _allocs(before, "temporary")[:3] == [8, 8, 8 * 2 * 3 * 3]
    assert _allocs(before, "ddp_bucket") == [3 * _LAYER]
    assert _allocs(recording.step_events(1), "ddp_bucket") == [_LAYER, 2 * _LAYER]


def test_replica_holds_the_single_gpu_states_plus_its_buckets():
    """A DDP rank's parameters, gradients and optimizer state are one GPU's (the same step
    recorded on the meta device); DDP adds its buckets: the constructor's and the rebuilt."""
    from oomkit.prediction.tracing import trace_step

    def states(recording):
        return {
            category: sorted(_allocs(recording.events, category))
            for category in ("parameter", "gradient", "optimizer_state")
        }

    ddp = trace_distributed_step(_build(), world_size=2, steps=2)
    with torch.device("meta"):
        model = torch.nn.Sequential(*(torch.nn.Linear(512, 512) for _ in range(3)))
        batch = torch.randn(4, 512)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(*_):
        model(batch).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    single = trace_step(step, model, optimizer, batch, steps=2)
    assert states(ddp) == states(single)
    assert sum(_allocs(ddp.events, "ddp_bucket")) == 3 * _LAYER + 3 * _LAYER


def _fsdp_linears(mesh, *, out_features: int, **fully_shard_kwargs):
    """Two fp32 Linear units (64 -> 256 -> ``out_features``), each and the whole under
    fully_shard, AdamW, a batch of 8: ``(step, tracked)`` for trace_distributed_step."""
    from torch.distributed.fsdp import fully_shard

    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, out_features))
    for layer in model:
        fully_shard(layer, mesh=mesh, **fully_shard_kwargs)
    fully_shard(model, mesh=mesh, **fully_shard_kwargs)
    optimizer = torch.optim.AdamW(model.parameters())
    batch = torch.randn(8, 64)

    def step():
        model(batch).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    return step, (model, optimizer, batch)


def _mixed_build(mesh):
    """Two fp32 Linear units under FSDP2 with bf16 parameters and a bf16 reduce dtype."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    return _fsdp_linears(mesh, out_features=8, mp_policy=policy)


def test_hsdp_all_reduce_is_in_place_and_casts_gradients_on_its_own_stream():
    """HSDP with a reduce dtype other than the parameters': _fsdp_collectives.py foreach_reduce
    all-reduces the bf16 reduce-scatter output in place (nothing allocated), casts it to the fp32
    gradient on the all-reduce stream (FSDP: on the reduce-scatter stream), and
    FSDPParamGroup._all_reduce_state keeps each bf16 output until backward ends (FSDP frees it
    at once)."""

    def grads_and_outputs(recording):
        events = list(recording.step_events(1))
        grads = [(i, e) for i, e in enumerate(events) if e.action == "alloc"
                 and dict(e.tags)["category"] == "gradient"]
        # The bf16 reduce-scatter outputs: 2,056 bytes (4,112 fp32 / 2) and 16,640 (33,280 / 2).
        outputs = {e.size: i for i, e in enumerate(events) if e.action == "alloc"
                   and e.size in (2056, 16640)}
        frees = {e.size: i for i, e in enumerate(events) if e.action == "free_requested"
                 and e.size in (2056, 16640)}
        return events, grads, outputs, frees

    fsdp = trace_distributed_step(_mixed_build, world_size=2, steps=2)
    hsdp = trace_distributed_step(
        _mixed_build, world_size=4, mesh_shape=((2, 2), ("dp", "fsdp")), steps=2
    )
    events, grads, outputs, frees = grads_and_outputs(fsdp)
    assert [e.size for _, e in grads] == [4112, 33280]  # fp32 shards of 8x256+8, 128x64+128
    output_stream = events[outputs[2056]].stream
    assert {e.stream for _, e in grads} == {output_stream}
    assert frees[2056] < grads[1][0]  # freed before the next unit reduces
    events, grads, outputs, frees = grads_and_outputs(hsdp)
    assert [e.size for _, e in grads] == [4112, 33280]
    output_stream = events[outputs[2056]].stream
    grad_streams = {e.stream for _, e in grads}
    assert len(grad_streams) == 1 and grad_streams != {output_stream} and 0 not in grad_streams
    assert frees[2056] > grads[1][0] and frees[16640] > grads[1][0]  # held to backward's end
    assert any("4 side stream(s)" in w for w in hsdp.warnings)
    # The all-reduce allocates nothing: the same allocations, by size, as FSDP over 2.
    sizes = sorted(e.size for e in fsdp.events if e.action == "alloc")
    assert sorted(e.size for e in hsdp.events if e.action == "alloc") == sizes


def _ddp_build(mesh, *, wrap_in_build):
    """Linear 64->256->5 in DDP with a 1 MiB cap, wrapped by build itself or by its setup."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 5))
    batch = torch.randn(8, 64)
    wrapped = []

    def wrap():
        wrapped.append(torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1))

    if wrap_in_build:
        wrap()
    optimizer = torch.optim.AdamW((wrapped[0] if wrapped else model).parameters())

    def step():
        wrapped[0](batch).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    if wrap_in_build:
        return step, (wrapped[0], optimizer, batch)
    return step, (model, optimizer, batch), wrap


def test_ddp_made_by_build_is_constructed_under_the_recorder():
    """A builder that wraps its model in DDP itself records what one wrapping in setup does,
    event for event: the constructor (broadcast, first buckets) runs under the recorder."""
    in_setup = trace_distributed_step(
        lambda mesh: _ddp_build(mesh, wrap_in_build=False), world_size=2, steps=2
    )
    in_build = trace_distributed_step(
        lambda mesh: _ddp_build(mesh, wrap_in_build=True), world_size=2, steps=2
    )
    buckets = [e.size for e in in_build.events if e.action == "alloc"
               and dict(e.tags)["category"] == "ddp_bucket"]
    assert buckets  # the constructor's bucket and the rebuilt ones are recorded
    assert [(e.action, e.size, dict(e.tags)["category"]) for e in in_build.events] == [
        (e.action, e.size, dict(e.tags)["category"]) for e in in_setup.events
    ]
    assert any(w.startswith("DDP: every replica") for w in in_build.warnings)
    assert torch.nn.parallel.DistributedDataParallel.__init__.__name__ != "init"


_BUCKET_NUMEL = 3 * (512 * 512 + 512)


@pytest.mark.parametrize(
    ("register", "copies"),
    [
        (lambda ddp: ddp.register_comm_hook(None, _default_hooks().bf16_compress_hook), True),
        (lambda ddp: ddp.register_comm_hook(None, _default_hooks().fp16_compress_hook), True),
        (lambda ddp: ddp.register_comm_hook(None, _default_hooks().allreduce_hook), False),
        (lambda ddp: ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS), True),
    ],
    ids=["bf16_compress_hook", "fp16_compress_hook", "allreduce_hook", "builtin FP16_COMPRESS"],
)
def test_a_script_s_comm_hook_runs_on_the_buckets(register, copies):
    """A DDP comm hook the script registers runs in place of oomkit's in-place allreduce (it
    had raised "register_comm_hook ... can only be called once", and bf16_compress_hook "required
    CUDA 11+ and NCCL 2.10+": the fake group stands for NCCL). The compress hooks make a 2-byte
    copy of the bucket (default_hooks.py _compress_hook ``buffer.to(dtype)``, 787,968 elements:
    1,575,936 bytes) as the bucket is reduced, freed once decompressed into the bucket;
    allreduce_hook divides in place and makes none. A second registration is refused, as DDP
    refuses it."""

    def hooked(ddp):
        register(ddp)
        with pytest.raises(RuntimeError, match="can only be called once"):
            ddp.register_comm_hook(None, _default_hooks().allreduce_hook)

    step_1 = trace_distributed_step(_build(then=hooked), world_size=2, steps=1).step_events(0)
    half = _BUCKET_NUMEL * 2
    assert [size for size in _allocs(step_1) if size == half] == ([half] if copies else [])
    frees = [e.size for e in step_1 if e.action == "free_completed" and e.size == half]
    assert frees == ([half] if copies else [])
    assert _allocs(step_1, "ddp_bucket") == []  # the bucket made before the step is reused


def _default_hooks():
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks
