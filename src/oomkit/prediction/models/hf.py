"""Hugging Face transformers models as prediction workloads, built from their config only.

transformers is an optional dependency (``pip install oomkit[hf]``), imported when used.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import os
import socket
import urllib.parse
from collections.abc import Iterator
from typing import Any

import torch

from oomkit._logs import TORCHAO_IMPORT_LOGGERS, quiet_loggers
from oomkit.errors import ConfigError, OomkitError, TorchRequiredError
from oomkit.prediction.models.bnb_config import bnb_step_fields
from oomkit.prediction.models.hf_attention import (
    ATTN_IMPLEMENTATIONS,
    build_attn_implementation,
    config_attn_implementation,
)
from oomkit.prediction.models.lora import prepare_finetune
from oomkit.prediction.models.model_cache import cached_model, model_cache_key
from oomkit.prediction.models.options import BuiltStep, Precision, StepOptions
from oomkit.prediction.models.presets import presets_said_for
from oomkit.prediction.models.selective_ac import selective_op_context
from oomkit.prediction.models.steps import ModelRunner, Task, build_step, model_dtype

__all__ = ["build_hf_step", "config_precision", "load_hf_config"]

# Default prompt/sequence length when StepOptions.seq_len is None: the model's own limit, capped
# (a 128K-token context is a deliberate choice, not a default).
_DEFAULT_SEQ_LEN_CAP = 2048


def _transformers() -> Any:
    try:
        # Its quantizers import torchao where installed: quietly here, as lora._peft does.
        with quiet_loggers(*TORCHAO_IMPORT_LOGGERS):
            import transformers
            import transformers.quantizers  # noqa: F401
    except ImportError as exc:
        raise TorchRequiredError(
            "building a Hugging Face model needs transformers; install it with "
            "`pip install oomkit[hf]`, or use a built-in preset (oomkit.prediction.models.PRESETS)"
        ) from exc
    return transformers


def load_hf_config(name_or_path_or_config: Any, *, local_files_only: bool = False) -> Any:
    """A ``PretrainedConfig`` from a config object, a local directory or a hub name.

    Args:
        name_or_path_or_config: a ``transformers.PretrainedConfig``; a directory holding
            ``config.json``; or a hub name such as ``"openai-community/gpt2"``.
        local_files_only: do not contact the hub (only the local cache), so a missing config
            fails at once instead of after network retries.

    Raises:
        OomkitError: the config cannot be found or read (no network, a typo, a gated model).
    """
    transformers = _transformers()
    if isinstance(name_or_path_or_config, transformers.PretrainedConfig):
        return name_or_path_or_config
    name = os.fspath(name_or_path_or_config)
    if os.path.isdir(name) and not os.path.isfile(os.path.join(name, "config.json")):
        raise OomkitError(
            f"{name} is a directory without config.json; point at a model directory saved with "
            "save_pretrained(), or pass a transformers config object"
        )
    if not os.path.isdir(name) and not local_files_only:
        # A hub name: the local cache first; then, only if the hub's host resolves, the network
        # (offline, huggingface_hub would retry for ~40 s before failing).
        try:
            return transformers.AutoConfig.from_pretrained(name, local_files_only=True)
        except (OSError, ValueError, KeyError):
            pass
        host = _hub_host()
        if not _resolves(host):
            raise OomkitError(
                f"could not load the Hugging Face config of {name!r}: it is not in the local cache "
                f"and {host} cannot be reached (no network?). Pass a local directory holding its "
                "config.json or a config object (e.g. transformers.AutoConfig.for_model('llama', "
                f"...)){presets_said_for(name)}"
            )
    try:
        return transformers.AutoConfig.from_pretrained(name, local_files_only=local_files_only)
    # Any failure reads the user's config (huggingface_hub's StrictDataclassError, raised by
    # transformers 5's config validators, is no ValueError).
    except Exception as exc:  # noqa: BLE001
        said = " ".join(str(exc).split())
        raise OomkitError(
            f"could not load the Hugging Face config of {name!r} ({type(exc).__name__}: "
            f"{said if len(said) <= 300 else said[:297] + '...'}). Without network access, pass a "
            "local directory holding its config.json or a config object (e.g. transformers."
            "AutoConfig.for_model('llama', ...)); check the spelling; for gated models log in "
            "with `huggingface-cli login`"
        ) from exc


def _hub_host() -> str:
    """The host of the Hugging Face endpoint (``HF_ENDPOINT``, else huggingface.co)."""
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    return urllib.parse.urlparse(endpoint).hostname or "huggingface.co"


def _resolves(host: str) -> bool:
    """Whether ``host`` has an address: a quick check before network retries."""
    try:
        socket.getaddrinfo(host, 443)
    except (OSError, UnicodeError):
        return False
    return True


_AUTO_CLASSES: tuple[tuple[str, str, Task], ...] = (
    ("MODEL_FOR_CAUSAL_LM_MAPPING", "AutoModelForCausalLM", "causal_lm"),
    ("MODEL_FOR_MASKED_LM_MAPPING", "AutoModelForMaskedLM", "masked_lm"),
    (
        "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING",
        "AutoModelForImageClassification",
        "image_classification",
    ),
)
# A transformers class name's ending -> the task it trains (modeling_auto.py's mappings:
# ...ForSequenceClassification computes its loss on [batch] class ids, ...ForTokenClassification
# on [batch, seq] ones, ...ForCausalLM / ...LMHeadModel shift the ids, ...ForMaskedLM does not).
_TASK_ENDINGS: tuple[tuple[str, Task], ...] = (
    ("ForSequenceClassification", "sequence_classification"),
    ("ForTokenClassification", "token_classification"),
    ("ForCausalLM", "causal_lm"),
    ("LMHeadModel", "causal_lm"),
    ("ForMaskedLM", "masked_lm"),
    ("ForImageClassification", "image_classification"),
)
# Sizes a config must give as positive integers (issue 36): a zero or negative one fails deep in
# torch (or builds nothing) instead of naming the field.
_POSITIVE_FIELDS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "vocab_size",
    "max_position_embeddings",
    "head_dim",
    "n_embd",
    "n_layer",
    "n_head",
    "n_positions",
    "n_inner",
    "num_labels",
    "image_size",
    "patch_size",
    "num_channels",
)


def _task_of(class_name: str) -> Task | None:
    return next((task for ending, task in _TASK_ENDINGS if class_name.endswith(ending)), None)


def _auto_class(transformers: Any, config: Any) -> tuple[Any, Task]:
    """The auto class that builds ``config`` and the task it implies.

    An encoder such as BERT is known to both the causal-LM and the masked-LM mappings
    (``BertLMHeadModel`` / ``BertForMaskedLM``); it is built as a masked LM unless its config says
    ``is_decoder``. Otherwise the first mapping (transformers' auto mappings, keyed by config
    class) that knows the config wins.
    """
    known = [
        (getattr(transformers, cls_name), task)
        for mapping, cls_name, task in _AUTO_CLASSES
        if type(config) in getattr(transformers, mapping)
    ]
    if not known:
        raise OomkitError(
            f"oomkit cannot build a {type(config).__name__} ({config.model_type}): it supports "
            "causal and masked language models, sequence and token classifiers and image "
            "classifiers; name the class (StepOptions(hf_class='AutoModelForCausalLM')), use a "
            "built-in preset, or trace your own step with oomkit.prediction.tracing.trace_step"
        )
    tasks = [task for _, task in known]
    if "masked_lm" in tasks and not getattr(config, "is_decoder", False):
        return known[tasks.index("masked_lm")]
    return known[0]


def _model_class(transformers: Any, config: Any, hf_class: str | None) -> tuple[Any, Task, Any]:
    """(the function that builds the model from ``config``, its task, the class) for what the
    user builds: ``hf_class`` when given; else the config's ``architectures[0]`` (what
    ``save_pretrained`` wrote: the class the user trained) where oomkit knows its task; else
    the auto class that knows the config (``_auto_class``).

    Raises:
        ConfigError: ``hf_class`` is not a transformers class, or not one whose task oomkit
            models.
    """
    name = hf_class
    if name is None:
        architectures = getattr(config, "architectures", None) or []
        name = next(
            (a for a in architectures if _task_of(a) and hasattr(transformers, a)), None
        )
        if name is None:
            auto, task = _auto_class(transformers, config)
            return auto.from_config, task, auto
    named_task = _task_of(name)
    cls = getattr(transformers, name, None)
    if cls is None or named_task is None:
        endings = ", ".join(ending for ending, _ in _TASK_ENDINGS)
        raise ConfigError(
            f"StepOptions.hf_class {name!r} is not a transformers model class oomkit builds: it "
            f"must name one ending in {endings} (e.g. 'AutoModelForSequenceClassification' or "
            "'BertForSequenceClassification'); check the spelling"
        )
    # An auto class picks the concrete class from its mapping (auto_factory.py from_config);
    # a concrete class is built as from_config builds it, by its _from_config.
    build = cls.from_config if name.startswith("Auto") else cls._from_config
    return build, named_task, cls


# Every layer is built and recorded, so the time a prediction takes grows with the layer count:
# a config naming a million layers ran for hours. The deepest released models have a few
# hundred (Llama 3.1 405B: 126); this bound is far past them.
MAX_HF_LAYERS = 10_000


def _check_sizes(config: Any, text: Any) -> None:
    """Refuse a config size that is not a positive integer, naming the field (issue 36), and a
    layer count past ``MAX_HF_LAYERS``."""
    for part in {id(config): config, id(text): text}.values():
        for field in _POSITIVE_FIELDS:
            value = getattr(part, field, None)
            if value is None or isinstance(value, list | tuple):
                continue
            number = isinstance(value, int | float) and not isinstance(value, bool)
            if not number or value < 1 or value != int(value):
                raise ConfigError(
                    f"the Hugging Face config's {field} must be a positive integer; got "
                    f"{value!r}. Fix it in config.json (or the config object) and predict again"
                )
        layers = getattr(part, "num_hidden_layers", None)
        if isinstance(layers, int | float) and layers > MAX_HF_LAYERS:
            raise ConfigError(
                f"the Hugging Face config's num_hidden_layers is {layers}: oomkit builds and "
                f"records every layer, and past {MAX_HF_LAYERS:,} that takes hours (the deepest "
                "released models have a few hundred). Fix it in config.json"
            )


# The precision of a model whose config names this dtype: from_config builds every parameter in
# it, and a training loop then keeps gradients and optimizer states in it too.
_PRECISION_OF_DTYPE: dict[torch.dtype, Precision] = {
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
}
FROM_CONFIG = "from the config's torch_dtype"
NO_CONFIG_DTYPE = "the default: the config names no torch_dtype"


def config_precision(config: Any) -> tuple[Precision, str]:
    """The precision ``from_config`` builds ``config`` in, and where that came from.

    modeling_utils.py ``PreTrainedModel._from_config``: the model is built under the config's
    dtype (``config.dtype``, from transformers 4.56; ``config.torch_dtype`` before, still read
    from older ``config.json`` files) as the default dtype; without one, under torch's default
    (fp32).

    Returns:
        ``("bf16", "from the config's torch_dtype")`` for a bfloat16 config; ``("fp32", "the
        default: ...")`` when it names none, or one oomkit has no precision for (``float64``:
        the model is then built in fp32, and the source says so).
    """
    dtype = _config_dtype(config)
    if dtype is None:
        return "fp32", NO_CONFIG_DTYPE
    precision = _PRECISION_OF_DTYPE.get(dtype)
    if precision is None:
        return "fp32", f"the default: the config's torch_dtype {dtype} is not modelled"
    return precision, FROM_CONFIG


def _config_dtype(config: Any) -> torch.dtype | None:
    """The dtype a config names (``dtype`` from transformers 4.56, ``torch_dtype`` before)."""
    # Newer configs read an older config.json's torch_dtype into `dtype`, and reading their
    # `torch_dtype` logs a deprecation: read it only where `dtype` does not exist.
    if hasattr(config, "dtype"):
        dtype = config.dtype
    else:
        dtype = getattr(config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)  # "bfloat16"; "auto" is no dtype
    return dtype if isinstance(dtype, torch.dtype) else None


def _dtype_keyword(transformers: Any) -> str:
    """``from_config``'s dtype keyword: ``dtype`` from transformers 4.56 on, ``torch_dtype``
    before (modeling_utils.py ``_from_config``; the old name now logs a deprecation)."""
    try:
        major, minor = (int(part) for part in transformers.__version__.split(".")[:2])
    except ValueError:
        return "dtype"
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"


@contextlib.contextmanager
def _unpacked_sequences(transformers: Any) -> Iterator[None]:
    """Tell transformers' mask builder our sequences are not packed, without reading values.

    masking_utils.py ``find_packed_sequence_indices`` (called in training, with no attention mask
    and no cache) tests ``(mask[:, -1] == 0).all()``, a data-dependent branch meta tensors cannot
    take. Our position ids are one ``arange`` per row, for which it returns ``None``; return that.
    """
    module: Any = getattr(transformers, "masking_utils", None)
    original = getattr(module, "find_packed_sequence_indices", None)
    if module is None or original is None:
        yield
        return
    module.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        module.find_packed_sequence_indices = original


def build_hf_step(
    name_or_path_or_config: Any,
    options: StepOptions,
    device: str = "meta",
    *,
    local_files_only: bool = False,
    quantization_config: Any = None,
) -> BuiltStep:
    """Build a transformers model from its config on ``device`` and return its step.

    The model is the class the user builds (``_model_class``): ``options.hf_class``, else the
    config's ``architectures[0]`` (``BertForSequenceClassification``: its head, its labels and
    its loss), else ``AutoModelForCausalLM`` (or ``...ForMaskedLM`` /
    ``...ForImageClassification``, whichever knows the config); built by ``from_config`` with
    ``options.attn_implementation``, else the config's own, else ``"sdpa"``
    (FlashAttention-2 and flex attention as emulated by ``hf_attention``), under
    ``torch.device(device)``: no weights are read. With
    no ``options.precision`` it is built as ``from_config`` builds it, in the config's
    ``torch_dtype`` (``config_precision``; the description and ``BuiltStep.precision_source``
    say so); a precision given is passed as ``from_config``'s dtype. A training step calls the
    model with ``labels=`` and takes ``outputs.loss`` (transformers' own loss: the logits
    upcast to fp32 by ``ForCausalLMLoss``), keeping ``outputs`` alive to the end of the step,
    as a training loop does.

    Args:
        name_or_path_or_config: a ``PretrainedConfig``, a directory with ``config.json`` or a
            hub name.
        options: as for presets. ``precision`` defaults to the config's ``torch_dtype``;
            ``seq_len`` to the model's maximum positions capped at 2048; ``image_size`` to the
            config's. ``generate`` uses a ``DynamicCache`` (grows by cat) and greedy decoding.
        device: where the model and inputs live; ``"meta"`` allocates nothing.
        local_files_only: for hub names, do not contact the hub.
        quantization_config: a ``transformers.BitsAndBytesConfig`` (or its dict) the model is
            loaded with: its 4-bit settings become ``options.quantize``, ``double_quant`` and
            ``compute_dtype`` (``bnb_config.bnb_step_fields``). Without it, a config that
            carries a ``quantization_config`` (a saved quantized model's ``config.json``) is
            read the same way, unless ``options.quantize`` is set.

    Returns:
        The step, objects to track, a description and the parameter count.

    Raises:
        TorchRequiredError: transformers is not installed.
        ConfigError: a config size below 1 (``hidden_size``, ``num_hidden_layers``,
            ``vocab_size``...), an ``hf_class`` oomkit does not build, an attention
            implementation not modelled, or FlashAttention-2 in fp32.
        OomkitError: the config cannot be loaded, the model type is not supported, or the
            sequence is longer than the model's positions.
    """
    transformers = _transformers()
    config = load_hf_config(name_or_path_or_config, local_files_only=local_files_only)
    options = _quantization(options, config, quantization_config)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    _check_sizes(config, text_config)
    from_config, task, model_class = _model_class(transformers, config, options.hf_class)
    source = None
    if options.precision is None:
        precision, source = config_precision(config)
        options = dataclasses.replace(options, precision=precision)
    attention = _attention(options, config, model_class)
    build_kwargs: dict[str, Any] = {
        "attn_implementation": build_attn_implementation(transformers, attention)
    }
    # from_config builds in the config's dtype, else torch's default dtype.
    if (_config_dtype(config) or torch.get_default_dtype()) != model_dtype(options.precision):
        # Another precision: as `from_config(config, dtype=...)` builds it (buffers such as
        # RoPE's inv_freq are made as transformers makes them, not cast afterwards).
        # _from_config sets the dtype on the config it is given: a copy, so that the caller's
        # config is left as it was.
        config = copy.deepcopy(config)
        build_kwargs[_dtype_keyword(transformers)] = model_dtype(options.precision)

    def build() -> tuple[torch.nn.Module, str]:
        with torch.device(device):
            model = from_config(config, **build_kwargs)
        if options.checkpointing != "none" and options.mode == "train":
            # modeling_utils.py _activation_checkpointing_enable: torch.utils.checkpoint with these
            # kwargs per layer, and enable_input_require_grads() for a model fed input_ids.
            # (transformers 5 renamed it activation_checkpointing_enable; the old name warns.)
            kwargs: dict[str, Any] = {"use_reentrant": options.checkpoint_reentrant}
            if options.checkpointing == "selective-op":  # the policy per checkpointed layer call
                kwargs.update(context_fn=selective_op_context, preserve_rng_state=False)
            if hasattr(model, "activation_checkpointing_enable"):
                model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        title = _title(name_or_path_or_config, config, model)
        if attention != "sdpa":
            title += f", {attention} attention"
        return model, prepare_finetune(model, options, title)  # quantize, LoRA

    # Within a batch search, built once and shared by its probes (model_cache.py): keyed by the
    # config's contents, as from_config reads them.
    contents = _config_contents(config)
    named = name_or_path_or_config
    source_name = os.fspath(named) if isinstance(named, str | os.PathLike) else None
    key = None if contents is None else model_cache_key(
        "hf", (source_name, contents), options, device, model_class, tuple(build_kwargs.items())
    )
    model, title = cached_model(key, build)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    max_positions = getattr(text, "max_position_embeddings", None) or getattr(
        text, "n_positions", None
    )
    seq_len = options.seq_len or min(max_positions or _DEFAULT_SEQ_LEN_CAP, _DEFAULT_SEQ_LEN_CAP)
    total = seq_len + (options.new_tokens if options.mode == "generate" else 0)
    if task != "image_classification" and max_positions is not None and total > max_positions:
        raise OomkitError(
            f"{config.model_type} has {max_positions} positions but the step needs {total} "
            f"tokens; use StepOptions(seq_len=...) of at most {max_positions} in total"
        )
    image_size = options.image_size or getattr(config, "image_size", None) or 224
    runner = _runner(transformers, model, task, config, text)
    return build_step(
        runner,
        options,
        title=title,
        seq_len=seq_len,
        image_size=image_size,
        device=device,
        precision_source=source,
    )


def _attention(options: StepOptions, config: Any, model_class: Any = None) -> str:
    """The attention implementation the model runs: ``options.attn_implementation``, else the
    config's own (``attn_implementation`` in config.json), else transformers' default: ``sdpa``
    where the class supports it, else ``eager`` (``get_correct_attn_implementation``: Gemma 2).

    Raises:
        ConfigError: the config names one oomkit does not model, or FlashAttention-2 is asked
            for in fp32 (flash_attn runs fp16 / bf16 only: flash_api.cpp mha_fwd checks
            ``q_dtype == at::kHalf || q_dtype == at::kBFloat16``).
    """
    if getattr(model_class, "__name__", "").startswith("Auto"):
        # The concrete class the auto class builds for this config (auto_factory.py
        # from_config: _model_mapping[type(config)]).
        model_class = getattr(model_class, "_model_mapping", {}).get(type(config), model_class)
    default = "sdpa" if getattr(model_class, "_supports_sdpa", True) else "eager"
    chosen = options.attn_implementation or config_attn_implementation(config) or default
    if chosen not in ATTN_IMPLEMENTATIONS:
        raise ConfigError(
            f"the config's attn_implementation {chosen!r} is not modelled; set one of "
            f"{', '.join(ATTN_IMPLEMENTATIONS)} with StepOptions(attn_implementation=...)"
        )
    if chosen == "flash_attention_2" and options.precision == "fp32":
        raise ConfigError(
            "FlashAttention-2 runs in fp16 or bf16 only (flash_attn mha_fwd refuses fp32): use "
            "StepOptions(precision='bf16-mixed') or 'bf16', or attn_implementation='sdpa'"
        )
    return chosen


def _quantization(options: StepOptions, config: Any, given: Any) -> StepOptions:
    """``options`` with the 4-bit settings of ``given`` or of the config's own
    ``quantization_config`` (transformers' ``BitsAndBytesConfig``).

    Raises:
        ConfigError: ``given`` together with ``options.quantize``, or settings not modelled.
    """
    if given is not None and options.quantize is not None:
        raise ConfigError(
            "give the quantization once: a quantization_config or StepOptions(quantize=...), "
            "not both"
        )
    if given is None:
        if options.quantize is not None:
            return options  # stated: it wins over the config's own
        given = getattr(config, "quantization_config", None)
        if given is None:
            return options
    fields = bnb_step_fields(given)
    try:
        return dataclasses.replace(options, **fields)
    except ValueError as exc:
        raise ConfigError(f"the quantization_config {fields} does not apply: {exc}") from exc


def _config_contents(config: Any) -> str | None:
    """Every value of ``config`` as JSON (what ``from_config`` reads), or ``None`` when it
    cannot be written so (the model is then built afresh each time)."""
    try:
        return str(config.to_json_string(use_diff=False))
    except (AttributeError, TypeError, ValueError):
        return None


def _title(source: Any, config: Any, model: torch.nn.Module) -> str:
    if isinstance(source, str | os.PathLike):
        return f"{os.fspath(source)} (Hugging Face)"
    millions = sum(p.numel() for p in model.parameters()) / 1e6
    return f"{type(model).__name__} {millions:.1f}M (Hugging Face {config.model_type})"


def _runner(transformers: Any, model: Any, task: Task, config: Any, text: Any) -> ModelRunner:
    # Training goes through the model's own loss (`labels=`), as transformers users train.
    if task == "image_classification":
        return ModelRunner(
            model,
            task,
            config.num_labels,
            forward=lambda x: model(pixel_values=x).logits,
            train_outputs=lambda x, labels: model(pixel_values=x, labels=labels),
        )
    if task in ("sequence_classification", "token_classification"):
        return ModelRunner(
            model,
            task,
            config.num_labels,
            forward=lambda ids: model(input_ids=ids).logits,
            train_outputs=lambda ids, labels: model(input_ids=ids, labels=labels),
            make_labels=lambda ids: _class_labels(config, task, ids),
        )
    if task == "masked_lm":
        return ModelRunner(
            model,
            task,
            text.vocab_size,
            forward=lambda ids: model(input_ids=ids).logits,
            train_outputs=lambda ids, labels: model(input_ids=ids, labels=labels),
        )

    # The cache's keyword: `cache` in newer transformers (`past_key_values` is deprecated there,
    # modeling_llama.py LlamaForCausalLM.forward), `past_key_values` before.
    forward_parameters = inspect.signature(model.forward).parameters
    cache_keyword = "cache" if "cache" in forward_parameters else "past_key_values"

    def new_cache() -> Any:
        # cache_utils.py DynamicCache: per-layer keys/values grown by torch.cat.
        return transformers.DynamicCache(config=model.config)

    def forward(ids: torch.Tensor) -> torch.Tensor:
        with _unpacked_sequences(transformers):
            return model(input_ids=ids, use_cache=False).logits

    def train_outputs(ids: torch.Tensor, labels: torch.Tensor) -> Any:
        # `outputs = model(input_ids=..., labels=...)` with the model's own use_cache default,
        # as a training loop calls it.
        with _unpacked_sequences(transformers):
            return model(input_ids=ids, labels=labels)

    return ModelRunner(
        model,
        task,
        text.vocab_size,
        forward=forward,
        train_outputs=train_outputs,
        new_cache=new_cache,
        decode=lambda ids, cache, keep: (
            model(input_ids=ids, **{cache_keyword: cache}, use_cache=True, logits_to_keep=keep)
        ).logits,
    )


def _class_labels(config: Any, task: Task, ids: torch.Tensor) -> torch.Tensor:
    """The labels a classifier's loss takes (modeling_bert.py BertForSequenceClassification
    .forward: ``problem_type`` "regression" for one label, else class ids, or float targets for
    "multi_label_classification"; ...ForTokenClassification: one class id per token)."""
    batch = ids.shape[0]
    if task == "token_classification":
        return torch.randint(config.num_labels, tuple(ids.shape), device=ids.device)
    problem = getattr(config, "problem_type", None)
    if problem == "regression" or (problem is None and config.num_labels == 1):
        return torch.randn(batch, device=ids.device)
    if problem == "multi_label_classification":
        return torch.randn(batch, config.num_labels, device=ids.device)
    return torch.randint(config.num_labels, (batch,), device=ids.device)
