"""Early-exit drafting (HF's ``assistant_early_exit``; LayerSkip's self-speculative decoding, Elhoushi et al. 2024):
the target's first N decoder layers, then its own final norm and LM head, draft for it.

HF's ``EarlyExitCandidateGenerator`` lowers ``config.num_hidden_layers`` on the target itself around each drafting
call, which only architectures whose forward slices their layers by it obey (the others run every layer over a cache
of N: an IndexError inside transformers, the lowered value left on the model) and which a second thread using the
model sees. Here the draft is a separate module object, built once per (model, N): copies of the modules on the path
from the model to its decoder-layer list (their own ``_modules``, a config with ``num_hidden_layers = N``), sharing
every parameter, buffer and layer module with the target (no weight is copied).
It goes through every check and runner a draft model goes through, and gets caches of its N layers.
"""

import ast
import copy
import functools
import inspect
import numbers
import textwrap
import threading
import weakref

import torch

# model -> {N: (key, view)}: one view per model and N while neither changes (compiled steps and continuous batching's
# joins key on the draft object)
_VIEWS: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()
_SEARCH_DEPTH = 3  # the layer list sits at most this far below the model (LlamaForCausalLM.model.layers: 2)


# methods that build or initialise the layers (they run before any forward, on the target itself)
_BUILDING = ("__init__", "_init_weights", "init_weights", "_initialize_weights", "post_init")


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def check_exit_layers(value, num_layers: int, source: str = "") -> int:
    """assistant_early_exit, validated: an int in [1, num_layers - 1] (num_layers: the target's decoder layers)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"assistant_early_exit must be an int (the number of the target's decoder layers that draft)"
                        f"{source}, got {type(value).__name__} {value!r}")
    if not 1 <= value < num_layers:
        raise ValueError(f"assistant_early_exit={value!r}{source} must be in [1, {num_layers - 1}]: the draft runs the "
                         f"target's first assistant_early_exit of its {num_layers} decoder layers (all of them would "
                         "draft what the target verifies, at the target's cost)")
    return int(value)


def requested_exit_layers(model, generation_config, kwargs: dict, drafting: bool, lookup_given: bool) -> int | None:
    """The call's ``assistant_early_exit``, checked, or None. Precedence as model.generate's: the keyword, then the
    passed generation_config, then the model's generation_config (a checkpoint's default, which yields to a draft
    model, drafter or prompt lookup the call passes; the call's own with one of those is refused). kwargs: generate's
    keywords (the field is left there: ``settings`` classifies it). drafting: the call passes draft_model or drafter;
    lookup_given: it passes prompt_lookup_num_tokens (keyword or generation_config)."""
    value, source = kwargs.get("assistant_early_exit"), ""
    if value is None and generation_config is not None:
        value = getattr(generation_config, "assistant_early_exit", None)
        source = " (in generation_config)" if value is not None else ""
    from_model = value is None
    if from_model:
        value = getattr(getattr(model, "generation_config", None), "assistant_early_exit", None)
        source = " (the model's generation_config)"
    if value is None:
        return None
    if drafting or lookup_given:
        if from_model:  # a checkpoint's default: the call's own way of drafting wins
            return None
        other = "draft_model (or assistant_model) / drafter=" if drafting else "prompt_lookup_num_tokens"
        raise ValueError(f"pass either assistant_early_exit (the target's first layers draft) or {other}, not both "
                         "(model.generate ignores the assistant model then)")
    if model.config.is_encoder_decoder:
        raise ValueError(f"assistant_early_exit{source} is supported for decoder-only models; "
                         f"{type(model).__name__} is an encoder-decoder (pass draft_model=)")
    return check_exit_layers(value, _layer_count(model), source)


def _layer_count(model) -> int:
    count = getattr(_text_config(model.config), "num_hidden_layers", None)
    if not isinstance(count, int) or count < 2:
        raise ValueError(f"assistant_early_exit: {type(model).__name__}'s config has no num_hidden_layers of 2 or "
                         f"more (got {count!r}), so it has no first layers to draft with; pass draft_model=")
    return count


def _decoder_path(model) -> list[str]:
    """The attribute path from model to its decoder (``get_decoder()``: LlamaForCausalLM's ``model``, a
    multimodal model's language model), [] where that is the model itself or it names none."""
    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else None
    if not isinstance(decoder, torch.nn.Module) or decoder is model:
        return []
    for name, module in model.named_modules():
        if module is decoder:
            return name.split(".")
    return []


def _layer_path(model, count: int) -> list[str]:
    """The attribute path from model to its decoder-layer list: the one ModuleList of ``count`` modules within
    ``_SEARCH_DEPTH`` levels of its decoder (not inside another ModuleList). ValueError where there is none, or
    several."""
    start = _decoder_path(model)
    found, frontier = [], [(tuple(start), model.get_submodule(".".join(start)))]
    for _ in range(_SEARCH_DEPTH):
        deeper = []
        for path, module in frontier:
            for name, child in module.named_children():
                if isinstance(child, torch.nn.ModuleList):
                    if len(child) == count:
                        found.append((*path, name))
                elif child is not None:
                    deeper.append(((*path, name), child))
        frontier = deeper
    if len(found) != 1:
        where = "none" if not found else ", ".join(".".join(p) for p in found)
        raise ValueError(f"assistant_early_exit: cannot tell {type(model).__name__}'s decoder layers (lists of "
                         f"num_hidden_layers={count} modules found: {where}); pass draft_model=")
    return list(found[0])


@functools.lru_cache(maxsize=None)
def _layer_count_reads(cls) -> tuple[str, ...]:
    """Where the classes of cls's MRO (less torch's and transformers' base classes) read ``num_hidden_layers``
    other than to build or initialise their layers (``_BUILDING``) or to slice them for the layer loop
    (``self.layers[: self.config.num_hidden_layers]``, the loop HF's own early exit relies on): each as
    "Class.method". A class whose source cannot be read is one entry."""
    reads = []
    for klass in cls.__mro__:
        module = klass.__module__ or ""
        if module == "builtins" or module.startswith("torch.") or (
                module.startswith("transformers.") and not module.startswith("transformers.models.")):
            continue  # (torch's and transformers' base classes and mixins: PreTrainedModel, GenerationMixin, ...)
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            reads.append(f"{klass.__name__} (its source cannot be read)")
            continue
        for function in ast.walk(tree):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)) or function.name in _BUILDING:
                continue
            sliced = {id(node.slice.upper) for node in ast.walk(function)
                      if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Slice)
                      and node.slice.lower is None and node.slice.upper is not None}
            if any(isinstance(node, ast.Attribute) and node.attr == "num_hidden_layers" and id(node) not in sliced
                   for node in ast.walk(function)):
                reads.append(f"{klass.__name__}.{function.name}")
    return tuple(reads)


def _check_truncatable(model, path: list[str]) -> None:
    """ValueError where the first layers alone would not run as the target runs them: layers sharing another's
    KV cache or taking inputs sized by the layer count, or code that reads num_hidden_layers beyond the loop."""
    text = _text_config(model.config)
    for name, what in (("num_kv_shared_layers", "its last layers reuse earlier layers' KV caches"),
                       ("hidden_size_per_layer_input", "its layers take per-layer inputs sized by the layer count")):
        if getattr(text, name, None):
            raise ValueError(f"assistant_early_exit is not supported for {type(model).__name__}: {what} ({name}="
                             f"{getattr(text, name)!r}); pass draft_model=")
    reads = [read for owner in _modules_on(model, path[:-1]) for read in _layer_count_reads(type(owner))]
    if reads:
        raise ValueError(f"assistant_early_exit is not supported for {type(model).__name__}: "
                         f"{', '.join(dict.fromkeys(reads))} read(s) num_hidden_layers beyond the loop over the "
                         "first layers, so the target's first layers could not run alone; pass draft_model=")


def _modules_on(model, path: list[str]) -> list[torch.nn.Module]:
    """model and each module along the attribute path below it."""
    modules = [model]
    for name in path:
        modules.append(getattr(modules[-1], name))
    return modules


def _view_key(model, path: list[str]) -> tuple:
    """What a view is built from: the modules on the path, their children (a head or an embedding replaced on the
    target, e.g. by resize_token_embeddings) and their own public plain attributes, which the view's copies take at
    build time (``training``: model.train() / eval(); ``gradient_checkpointing``), the layer list's modules, and the
    config's contents with its private fields (``_attn_implementation_internal``: set_attn_implementation; not in
    its JSON). A model whose modules, mode or config changed gets a new view."""
    owners = _modules_on(model, path)
    children = tuple(id(child) for owner in owners for child in owner._modules.values())
    plain = tuple(tuple(sorted((name, value) for name, value in vars(owner).items()
                               if not name.startswith("_") and _is_plain(value)))
                  for owner in owners)  # (not the private ones: generate's bookkeeping, _previous_max_cache_length)
    return children, plain, model.config.to_json_string(use_diff=False), _private_fields(model.config)


def _is_plain(value) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))


def _private_fields(config) -> tuple:
    """config's and its sub-configs' private plain fields (``_attn_implementation_internal``, ...), as a tuple."""
    fields = []
    for name, value in sorted(vars(config).items()):
        if name.startswith("_") and _is_plain(value):
            fields.append((name, value))
        elif hasattr(value, "to_json_string") and hasattr(value, "model_type"):  # (a sub-config)
            fields.append((name, _private_fields(value)))
    return tuple(fields)


def early_exit_draft(model, exit_layers: int) -> torch.nn.Module:
    """The draft of ``assistant_early_exit=exit_layers``: model (a decoder-only causal LM) running only its first
    exit_layers decoder layers, then its final norm and LM head. Same inputs and outputs as model ([B, T] ids ->
    logits [B, T, V]); every parameter and buffer is model's own. The same object while nothing ``_view_key`` reads
    changes (the path's modules, their mode, the config)."""
    path = _layer_path(model, _layer_count(model))
    key = _view_key(model, path)
    _check_truncatable(model, path)
    with _LOCK:
        cached = _VIEWS.setdefault(model, {}).get(exit_layers)
        if cached is not None and cached[0] == key:
            return cached[1]
        view = _build_view(model, path, exit_layers)
        _VIEWS[model][exit_layers] = (key, view)
        return view


def _build_view(model, path: list[str], exit_layers: int) -> torch.nn.Module:
    config = copy.deepcopy(model.config)
    text = _text_config(config)
    old_text = _text_config(model.config)
    count = text.num_hidden_layers
    text.num_hidden_layers = exit_layers
    layer_types = getattr(text, "layer_types", None)  # (the caches are built from it: one entry per layer)
    if isinstance(layer_types, (list, tuple)) and len(layer_types) == count:
        text.layer_types = type(layer_types)(layer_types[:exit_layers])
    configs = {id(model.config): config, id(old_text): text}
    modules = _modules_on(model, path[:-1])
    for module in modules:
        if "forward" in vars(module):
            raise ValueError(f"assistant_early_exit: {type(module).__name__}.forward is replaced on the instance (e.g. "
                             "by torch.compile(model.forward) or accelerate's hooks), which the draft's copy of it "
                             "would run on the whole model; undo that (compile=True captures the decoding steps), or "
                             "pass draft_model=")
    copies = []
    for module in modules:
        clone = copy.copy(module)  # the attributes shared; _modules its own, so that replacing a child stays here
        clone._modules = type(module._modules)(module._modules)
        if id(getattr(module, "config", None)) in configs:
            clone.config = configs[id(module.config)]
        copies.append(clone)
    for parent, name, child in zip(copies, path, copies[1:]):
        setattr(parent, name, child)
    layers = getattr(modules[-1], path[-1])
    first = torch.nn.ModuleList(list(layers)[:exit_layers])
    first.training = layers.training  # (a new module is in training mode)
    setattr(copies[-1], path[-1], first)
    return copies[0]
