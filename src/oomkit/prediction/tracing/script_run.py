"""Record a whole training script, run as ``python train.py ARGS`` would run it, on one emulated GPU.

``record_script(ScriptSpec("train.py", ("config/x.py", "--batch_size=8")))`` runs the file as
its ``__main__`` (``runpy.run_path``): ``sys.argv`` is ``["train.py", *args]`` (argparse and
nanoGPT's ``configurator.py`` read it), the script's folder is first on ``sys.path`` (sibling
imports), the working directory is the caller's (or ``cwd``), and files it reads are read (data
from disk is real CPU data). The default device stays the CPU, as in ``python train.py``.

What differs from a plain run, while it runs (all undone after):
- CUDA is one emulated GPU, the target (``cuda_device.as_one_cuda_gpu``): ``device = "cuda" if
  torch.cuda.is_available() else "cpu"`` picks CUDA, ``.to(device, non_blocking=True)`` of a CPU
  batch is an allocation on the target, and the model moved there lands on meta.
- Everything runs under a ``Tracer``: the model build, an evaluation pass before the first
  step, the steps. A step ends at each optimizer step (``optimizer.step()``, through
  ``scaler.step(optimizer)``, Lightning's, Hugging Face's or accelerate's optimizer step: all
  end in ``torch.optim.Optimizer.step``, whose global post hooks run after it,
  torch/optim/optimizer.py ``profile_hook_step``). The next step starts at the next forward of
  a module in training mode with grad enabled.
- After ``steps`` optimizer steps the script is stopped (a ``BaseException`` raised from the
  optimizer's post hook, which ``except Exception`` in the script does not catch): no further
  iteration, no checkpoint after the steps. ``torch.save`` does not write while the script runs
  (a checkpoint holds no GPU memory; meta tensors have no values to save); each call is noted.
- ``torch.compile`` in the script is recorded as compiled (``Tracer(compile=True)``).
- torchrun-style code (``torch.distributed.init_process_group``, ``DistributedDataParallel``) is
  refused, unless ``world_size`` is given: then the script runs as rank 0 (or ``rank``) of a
  fake process group of that many (``distributed.FakeWorld``, as a builder's ``--fsdp`` step
  does), under torchrun's environment, its host work real (``host_compute.py``); FSDP1 is
  refused there.
- accelerate's process-wide state starts empty, as in a new process (``fresh_accelerate_state``).

Where it may differ: the model is built where the script builds it (on the CPU, for real, before
``.to(device)``), which costs host memory and time for a large model; a script that writes files
before its first optimizer step (an output folder, a logger's directory) writes them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import runpy
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from oomkit._logs import TORCHAO_IMPORT_LOGGERS, quiet_loggers
from oomkit.core.allocator import AllocatorConfig
from oomkit.core.allocator.versions import alloc_conf_variables
from oomkit.core.gpus import GpuSpec
from oomkit.core.target import ParallelLayout, Target
from oomkit.core.trace.step_count import check_step_count
from oomkit.errors import ConfigError, OomkitError, UserCodeError
from oomkit.prediction.tracing.autocast import cuda_autocast_construction
from oomkit.prediction.tracing.batch_finders import (
    batch_finder_note,
    batch_finders_noticed,
    tuner_note,
)
from oomkit.prediction.tracing.cpu_inputs import cpu_inputs_refused
from oomkit.prediction.tracing.cuda_device import as_one_cuda_gpu
from oomkit.prediction.tracing.cuda_streams import current_stream_id
from oomkit.prediction.tracing.recorder import Tracer
from oomkit.prediction.tracing.recording import TraceRecording
from oomkit.prediction.tracing.script_steps import (
    MAX_SCRIPT_ENTRIES,
    ScriptProgress,
    ScriptTooLong,
    StepWatch,
    StopScript,
)
from oomkit.prediction.tracing.skipped_saves import saves_skipped
from oomkit.prediction.tracing.spawned_ranks import spawn_runs_rank
from oomkit.prediction.tracing.step_failure import (
    exit_call,
    failure_site,
    failure_text,
    os_exit_raises,
    step_failure,
)
from oomkit.prediction.tracing.step_memory import OomsRaised, ooms_raised
from oomkit.prediction.tracing.torch_globals import caller_globals_kept

if TYPE_CHECKING:
    from oomkit.prediction.tracing.distributed import FakeWorld

__all__ = [
    "MAX_SCRIPT_ENTRIES",
    "ScriptOutOfMemory",
    "ScriptProgress",
    "ScriptRun",
    "ScriptSpec",
    "fresh_accelerate_state",
    "record_script",
]

_DISTRIBUTED_ROUTE = (
    "Give the number of ranks it runs on, as torchrun starts it (--nproc-per-node times "
    "--nnodes): `oomkit predict train.py --world-size 8 -- ARGS` runs it as rank 0 of a fake "
    "process group of 8, its init_process_group, LOCAL_RANK, DDP and fully_shard as written "
    "(--rank R for another rank, --all-ranks for each)"
)


class ScriptOutOfMemory(OomkitError):
    """The script ran out of the target GPU's memory (``record_script(ooms=True)``) and did not
    catch it; the message is PyTorch's."""


@dataclass(frozen=True)
class ScriptSpec:
    """A script to run, as ``python path *argv`` would, and how many optimizer steps to record.

    Attributes:
        path: the script file (``train.py``), as the user gave it.
        argv: the script's own arguments (what follows ``--`` on oomkit's command line).
        steps: optimizer steps to record (3 shows the first step's optimizer state and the
            steady state after it).
        cwd: the working directory it runs in; ``None`` is the caller's.
    """

    path: str
    argv: tuple[str, ...] = ()
    steps: int = 3
    cwd: str | None = None

    def __post_init__(self) -> None:
        check_step_count(self.steps, "ScriptSpec('train.py', steps=3)")
        if not all(isinstance(arg, str) for arg in self.argv):
            raise OomkitError(
                f"the script's arguments must be strings, as on a command line; got {self.argv!r}"
            )

    @property
    def description(self) -> str:
        """``train.py config/x.py --n_layer=2``: the command line the script sees."""
        return " ".join([self.path, *self.argv])


@dataclass(frozen=True)
class ScriptRun:
    """What recording a script gave.

    Attributes:
        recording: the allocations of everything the script ran up to its last recorded
            optimizer step; ``step_starts`` marks each step.
        spec: the script and arguments run.
        steps_recorded: optimizer steps reached (``spec.steps``, or fewer when the script ended
            first; a warning in ``recording`` then says so).
        saves_skipped: ``torch.save`` calls that were not written.
        notes: what the run's warnings say about it (steps fewer than asked, saves skipped).
        layout: a torchrun script's ranks (``world_size``) as a layout for NCCL's
            communicators: its device mesh's dimensions (``cuda_ranks.script_layout``), else
            one communicator over all, DDP replicas when it wrapped a model in DDP, else FSDP
            ranks; ``None`` for one GPU.
    """

    recording: TraceRecording
    spec: ScriptSpec
    steps_recorded: int
    saves_skipped: int = 0
    notes: tuple[str, ...] = field(default=())
    layout: ParallelLayout | None = None

    @property
    def description(self) -> str:
        """The command line, for reports."""
        return self.spec.description


# The script's warnings already shown in this process: (message, category, file, line).
_WARNINGS_SHOWN: set[tuple[str, type, str, int]] = set()


@contextlib.contextmanager
def _warnings_once() -> Iterator[None]:
    """While open, a warning the script's runs have shown in this process is not shown again.

    Python's default action shows a warning once per place, in the registry of the module that
    issued it; a script is a new ``__main__`` each run, with a new registry, so each of the runs
    a batch search makes (``oomkit fit train.py``) printed the script's FutureWarnings again. A
    warning a filter or ``catch_warnings`` handles is theirs: only the showing is deduplicated.
    """
    previous = warnings.showwarning

    def once(message: Warning | str, category: type[Warning], filename: str, lineno: int,
             file: Any = None, line: str | None = None) -> None:
        key = (str(message), category, filename, lineno)
        if key not in _WARNINGS_SHOWN:
            _WARNINGS_SHOWN.add(key)
            previous(message, category, filename, lineno, file, line)

    warnings.showwarning = once
    try:
        yield
    finally:
        if warnings.showwarning is once:  # the script may have put its own in place
            warnings.showwarning = previous


@contextlib.contextmanager
def _as_main(path: Path, argv: tuple[str, ...], cwd: str | None) -> Iterator[None]:
    """``sys.argv``, ``sys.path`` and the working directory as ``python path *argv`` sets them;
    modules imported from the script's folder are forgotten after (a later script's ``model``
    is its own)."""
    folder = str(path.parent)
    saved_argv, saved_path, saved_cwd = sys.argv, list(sys.path), os.getcwd()
    known = set(sys.modules)
    sys.argv = [str(path), *argv]
    sys.path.insert(0, folder)
    if cwd is not None:
        os.chdir(cwd)
    try:
        yield
    finally:
        sys.argv = saved_argv
        sys.path[:] = saved_path
        os.chdir(saved_cwd)
        from oomkit.prediction.tracing.stand_ins import is_hidden_file, is_library_file

        for name in set(sys.modules) - known:
            found = getattr(sys.modules[name], "__file__", None)
            if not isinstance(found, str):
                continue
            module_file = os.path.abspath(found)
            # The script's own modules only: a virtualenv inside the project folder holds
            # libraries (torch's lazily imported parts) that must stay imported.
            if (
                module_file.startswith(folder + os.sep)
                and not is_library_file(module_file)
                and not is_hidden_file(module_file)
            ):
                del sys.modules[name]


# accelerate keeps one state per process in Borg classes (accelerate/state.py: PartialState,
# AcceleratorState, GradientState share `_shared_state`); Accelerator(mixed_precision=...) refuses
# a state set up differently before. A script starts in a fresh process.
_ACCELERATE_STATES = ("PartialState", "AcceleratorState", "GradientState")


def _accelerate_states() -> list[dict[str, Any]]:
    module = sys.modules.get("accelerate.state")
    shared = [getattr(getattr(module, name, None), "_shared_state", None) for name in _ACCELERATE_STATES]
    return [state for state in shared if isinstance(state, dict)]


@contextlib.contextmanager
def fresh_accelerate_state() -> Iterator[None]:
    """While open, accelerate's process-wide state starts empty, as in a new process; the
    caller's is put back after."""
    saved = [(state, dict(state)) for state in _accelerate_states()]
    for state, _ in saved:
        state.clear()
    try:
        yield
    finally:
        for state in _accelerate_states():
            state.clear()
        for state, before in saved:
            state.update(before)


@contextlib.contextmanager
def _patched(owner: Any, name: str, value: Any) -> Iterator[None]:
    original = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)


def _user_line() -> str:
    """The script's innermost line on the stack (``train.py:85``)."""
    from oomkit.prediction.tracing.stand_ins import is_hidden_file, is_library_file, shown_path

    frame: Any = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not (is_hidden_file(filename) or is_library_file(filename)):
            return f"{shown_path(filename)}:{frame.f_lineno}"
        frame = frame.f_back
    return "a line oomkit could not find"


@contextlib.contextmanager
def _distributed_refused(where: str) -> Iterator[None]:
    """``init_process_group`` and ``DistributedDataParallel(...)`` raise, naming the line."""

    def refuse(what: str) -> Any:
        def refused(*args: Any, **kwargs: Any) -> Any:
            raise UserCodeError(
                f"{where}: {_user_line()} calls {what}: a torchrun-style distributed script. "
                f"{_DISTRIBUTED_ROUTE}."
            )

        return refused

    with contextlib.ExitStack() as stack:
        import torch.distributed as dist

        if hasattr(dist, "init_process_group"):
            stack.enter_context(
                _patched(dist, "init_process_group", refuse("torch.distributed.init_process_group"))
            )
        ddp = torch.nn.parallel.DistributedDataParallel
        stack.enter_context(_patched(ddp, "__init__", refuse("DistributedDataParallel(...)")))
        yield


@contextlib.contextmanager
def _fsdp1_refused(where: str) -> Iterator[None]:
    """``FullyShardedDataParallel(...)`` (FSDP1) raises, naming the line: on the fake group its
    checks find no accelerator (fully_sharded_data_parallel.py ``_init_device_handle``)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    def refused(*args: Any, **kwargs: Any) -> None:
        raise UserCodeError(
            f"{where}: {_user_line()} wraps a model in FullyShardedDataParallel (FSDP1), which "
            "oomkit does not run on its fake process group; FSDP2's fully_shard(model) runs as "
            "written (torch.distributed.fsdp.fully_shard), or predict one rank of a preset or "
            "a builder with --fsdp N"
        )

    with _patched(FullyShardedDataParallel, "__init__", refused):
        yield


def record_script(
    path: str | os.PathLike[str],
    argv: Sequence[str] = (),
    *,
    steps: int = 3,
    cwd: str | os.PathLike[str] | None = None,
    target: Target | None = None,
    gpu: GpuSpec | None = None,
    values: Mapping[str, Any] | None = None,
    compile: bool = True,
    progress: Callable[[ScriptProgress], None] | None = None,
    world_size: int | None = None,
    rank: int = 0,
    ooms: bool = False,
) -> ScriptRun:
    """Run ``path`` as ``python path *argv`` would, on one emulated GPU, and record it up to its
    ``steps``-th optimizer step (module docstring).

    Args:
        path: the script file.
        argv: the script's own arguments (``sys.argv[1:]`` as it sees them).
        steps: optimizer steps to record.
        cwd: the working directory it runs in (relative paths it opens start there, and
            ``path`` is looked up there when relative); ``None`` is the current one.
        target: the target machine (its GPU is what ``torch.cuda`` reports); or ``gpu``.
        gpu: the target GPU when ``target`` is not given; ``None`` is an H100 SXM.
        values: tensor values the script reads, by the line that reads them
            (``{"train.py:42": 1024}``).
        compile: record the script's ``torch.compile`` calls as compiled (Inductor emulated);
            False runs compiled code eagerly, with a warning.
        progress: called with a ``ScriptProgress`` every 64 module calls, after each optimizer
            step and once when the script has ended (a progress display); ``None``: none.
        world_size: a torchrun script's ranks (``torchrun --nproc-per-node`` times
            ``--nnodes``): it runs as ``rank`` of a fake process group of that many
            (``distributed.FakeWorld``), its ``init_process_group``, ``LOCAL_RANK``,
            ``DistributedDataParallel`` and ``fully_shard`` as written. ``None``: one GPU, and
            such a script is refused.
        rank: the rank it runs as, with ``world_size`` (``RANK``, ``get_rank()``, the rank
            ``mp.spawn`` starts); 0 without.
        ooms: a request the target GPU cannot serve raises ``torch.OutOfMemoryError`` in the
            script, as on the GPU (``step_memory.ooms_raised``): a script that catches it (a
            batch finder) goes on as there; one that does not raises ``ScriptOutOfMemory``.
            False: no limit (the whole run is recorded, for the memory it needs).

    Returns:
        The recording, the steps reached and the saves skipped.

    Raises:
        OomkitError: ``steps`` is not a whole number from 1 to ``MAX_RECORDED_STEPS``, or an
            argument is not a string.
        UserCodeError: the file is missing; the script raised, exited (``sys.exit`` with a
            non-zero code, or any exit before its first optimizer step), ended without an
            optimizer step, or runs torchrun-style distributed code without ``world_size``
            (or FSDP1 with it). The message names the script's line.
        UnsupportedOpError: an op of the script cannot run on the meta device; the message
            names the script's line.
        DataDependentValueError: a tensor value oomkit cannot know is used as a size, a loop
            bound or a condition.
    """
    spec = ScriptSpec(
        os.fspath(path), tuple(argv), steps, None if cwd is None else os.fspath(cwd)
    )
    path = Path(spec.path)
    base = Path(spec.cwd) / path if spec.cwd is not None and not path.is_absolute() else path
    if not base.is_file():
        raise UserCodeError(
            f"{spec.path}: no such script (looked in {base.resolve().parent}). Give the path of "
            "the training script, as you would to python."
        )
    script = base.resolve()
    emulations = None
    if target is not None:
        gpu = target.gpu
        # As trace_step: a stated cuDNN or torch version is passed explicitly.
        from oomkit.prediction.tracing.emulations import emulations_for

        emulations = emulations_for(target.cudnn_version, target.torch_version)
    where = spec.path
    saves = [0]
    raised: OomsRaised | None = None  # with ooms: what the target GPU refused
    finder_starts: list[int] = []  # accelerate's find_executable_batch_size (batch_finders.py)
    tuner_searches: list[str] = []  # Lightning's Tuner searches run (batch_finders.py)
    world: FakeWorld | None = None
    if world_size is not None:
        from oomkit.prediction.tracing.distributed import FakeWorld

        world = FakeWorld(world_size, rank=rank, gpu=gpu, target=target, emulations=emulations,
                          compile=compile, values=values, host_inputs=True)
        tracer = world.tracer
    else:
        tracer = Tracer(emulations=emulations, gpu=gpu, values=values, compile=compile,
                        target=target)
        tracer.current_stream = current_stream_id  # the script's own streams (cuda_streams.py)
    watch = StepWatch(tracer, spec.steps, progress)
    stopped = False
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(caller_globals_kept())  # the script's settings end with it
            if world is not None:
                # The rank of the fake group: torchrun's environment, DDP, FSDP2 as written.
                from oomkit.prediction.tracing.host_compute import HostComputeReal

                stack.enter_context(world.opened())
                stack.enter_context(world.recording())
                host = stack.enter_context(HostComputeReal(world.fake_mode))  # host work: real
                stack.enter_context(host.broadcasts_kept())
                stack.enter_context(_fsdp1_refused(where))
                stack.enter_context(watch)
            else:
                stack.enter_context(tracer)
                stack.enter_context(watch)
                cuda_version = None if target is None else target.cuda_version
                cudnn_version = None if target is None else target.cudnn_version
                stack.enter_context(as_one_cuda_gpu(
                    tracer.gpu, cuda_version=cuda_version, cudnn_version=cudnn_version
                ))
                stack.enter_context(cpu_inputs_refused())
                stack.enter_context(cuda_autocast_construction())
                stack.enter_context(_distributed_refused(where))
            stack.enter_context(saves_skipped(saves))
            stack.enter_context(spawn_runs_rank(rank))  # mp.spawn(train, nprocs=N): here
            stack.enter_context(batch_finders_noticed(finder_starts, tuner_searches))
            if ooms:
                raised = stack.enter_context(ooms_raised(_config_at_first_use(alloc_conf_variables())))
            stack.enter_context(fresh_accelerate_state())
            stack.enter_context(_as_main(script, spec.argv, spec.cwd))
            stack.enter_context(_warnings_once())
            # The script's imports (transformers' quantizers import torchao when installed):
            # torchao's "Failed to load ..._C_*.so" is this CPU machine's, not the GPU run's.
            stack.enter_context(quiet_loggers(*TORCHAO_IMPORT_LOGGERS))
            stack.enter_context(os_exit_raises())
            try:
                runpy.run_path(str(script), run_name="__main__")
            except StopScript:
                stopped = True
            except ScriptTooLong as exc:
                raise UserCodeError(f"{where}: {exc}") from None
    except SystemExit as exc:
        if exc.code not in (None, 0) or (watch.done == 0 and not _allocated(tracer)):
            raise UserCodeError(_exit_text(where, exc, watch.done)) from exc
    except OomkitError as exc:
        if str(exc).startswith(where):
            raise
        raise type(exc)(f"{where}: {exc}") from exc
    except Exception as exc:
        if raised is not None and raised.count and isinstance(exc, torch.OutOfMemoryError):
            raise ScriptOutOfMemory(f"{where}: {exc}") from exc
        failed = tracer.failed_op
        if failed is not None and failed[1] is exc:
            error: OomkitError = step_failure(exc, failed[0])
        else:
            error = UserCodeError(failure_text(exc).replace("the step", "the script", 1))
        raise type(error)(f"{where}: {error}") from exc
    if watch.done == 0 and not _allocated(tracer):
        raise UserCodeError(
            f"{where}: the script ended without putting anything on the GPU and without an "
            "optimizer step (no optimizer.step(), scaler.step(optimizer) or trainer step ran), "
            "so there is nothing to predict. Check the arguments after `--`, and that the "
            'script puts its model on "cuda".'
        )
    notes: list[str] = []
    if watch.done == 0:
        notes.append(
            "no optimizer step ran: the prediction is of the whole script's run, to its end "
            "(an inference or evaluation script). If it is a training script, check its "
            "arguments after `--`: this run holds no training step"
        )
    elif not stopped:
        notes.append(
            f"the script ended after {watch.done} optimizer step(s), fewer than the "
            f"{spec.steps} asked for; the prediction is of those"
        )
    several = watch.several_optimizers_note()
    if several is not None:
        notes.append(several)
    if saves[0]:
        notes.append(f"torch.save was called {saves[0]} time(s) and wrote nothing (oomkit skips it)")
    caught = 0 if raised is None else raised.count
    finder = batch_finder_note(finder_starts, spec.path, caught)
    tuner = tuner_note(tuner_searches, caught)
    if finder is not None:
        notes.append(finder)
    if tuner is not None:
        notes.append(tuner)
    elif caught and finder is None:
        notes.append(
            f"the script caught {caught} out-of-memory error(s), raised where a request did not "
            f"fit on {tracer.gpu.name} as on the GPU, and went on: the prediction is of the run "
            "as it went, its failed attempts included (freed as they unwound)"
        )
    layout = None
    if world is not None and world_size is not None:
        from oomkit.prediction.tracing.cuda_ranks import script_layout

        layout, guessed = script_layout(world_size, bool(world.ddp.wrapped), world.meshes)
        if guessed is not None:
            notes.append(guessed)
    recording = tracer.recording if world is None else world.recorded()
    watch.report(watch.entries, ended=True)
    if notes:
        recording = dataclasses.replace(recording, warnings=(*recording.warnings, *notes))
    if stopped:  # the run after the last step asked for is not seen: said beside the answer
        recording = dataclasses.replace(recording, assumptions={
            **recording.assumptions,
            "script stopped": f"after its first {watch.done} optimizer step(s) (--steps); what "
            "it runs after them (an evaluation loop, a checkpoint, later epochs of other sizes) "
            "is not recorded, so taken to need no more; raise --steps to record it",
        })
    return ScriptRun(recording, spec, watch.done, saves[0], tuple(notes), layout)


def _config_at_first_use(before: dict[str, str | None]) -> Callable[[Target], AllocatorConfig]:
    """The allocator setting at the step's first request: one the script set itself in
    ``os.environ`` (PyTorch reads its variable then), as the report's replay takes it
    (``own_alloc_conf.with_own_setting``); else the target's."""

    def config_of(target: Target) -> AllocatorConfig:
        now = alloc_conf_variables()
        if now == before:
            return target.allocator_config
        given = {name: value for name, value in now.items() if value is not None}
        try:
            with warnings.catch_warnings():  # the report says them (with_own_setting)
                warnings.simplefilter("ignore")
                return AllocatorConfig.from_env(given, target.torch_version)
        except ConfigError:  # the report refuses it, saying why
            return target.allocator_config

    return config_of


def _allocated(tracer: Tracer) -> bool:
    """Whether the script put anything on the GPU (its recording has a request)."""
    return any(event.action == "alloc" for event in tracer.recording.events)


def _exit_text(where: str, exc: SystemExit, steps_done: int) -> str:
    site = failure_site(exc).user or "a line oomkit could not find"
    said = exit_call(exc)
    if steps_done == 0:
        why = "it put nothing on the GPU" if exc.code in (None, 0) else "it reports a failure"
        return (
            f"{where}: the script called {said} at {site} before its first optimizer step, and "
            f"{why}, so there is nothing to predict. Check the script's arguments (after `--`) "
            "and the files it reads."
        )
    return (
        f"{where}: the script called {said} at {site} after {steps_done} optimizer step(s): "
        "it reports a failure, so its run is not one to predict. Fix what it reports, or ask "
        f"for {steps_done} step(s)."
    )
