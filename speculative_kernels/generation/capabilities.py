"""Which architectures each cache path drives exactly: one check per request, run before anything is allocated.

``check_request(target, draft, path=..., batch=...)`` returns each model's ``ModelSpec`` (how a runner drives it), or
raises a ``ValueError`` naming the architecture and the reason. Paths: "dynamic" (HF ``DynamicCache``), "static"
(``SlotCache``), "compile" (the static path under ``torch.compile``). Why each rule exists: ``docs/architectures.md``.
"""

import dataclasses
import functools
import inspect
import re

import torch
import transformers
import transformers.cache_utils

from .adapters import adapter_randomness, idle_adapter_modules
from .hooks import hooks_reason, neftune_alpha, row_hooks_reason
from .step_size import bounded_mixers, bounds_shown, unread_limit_classes
from .wrapped_seq2seq import (decoder_kv_sizes, encoder_input_name, is_wrapper, wrapped_position_kind,
                              wrapped_position_limit)

# Layer types whose cache holds per-token K/V that the runners can mask and roll back.
ATTENTION_LAYERS = {"full_attention", "sliding_attention"}
# Layers without a cache of their own (MoE/MLP-only layers, KV-sharing consumers).
CACHELESS_LAYERS = {"dummy", "moe", "mlp"}
RECURRENT_LAYERS = {"conv", "linear_attention", "hybrid", "hybrid_sliding", "mamba", "mamba2", "ssm", "recurrent",
                    "rwkv", "lightning_attention", "linear", "deltanet", "gated_deltanet", "kda", "m", "s"}
# Recurrent layer kinds HF's dynamic cache holds as ``LinearAttentionLayer`` (conv and recurrent states), alone or
# beside a full-attention K/V (``LinearAttentionAndFullAttentionLayer``), in transformers 5.17 to 5.24.
STATE_LAYERS = {"linear_attention", "conv", "hybrid"}
# Models whose recurrent states ``runners.recurrent.RecurrentRunner`` rolls back exactly (a snapshot of the states
# before each forward, restored, and the kept tokens fed again): their forward over several tokens continues the
# cached state, as one-token steps do (tiny random models: logits within 1e-6 of the steps' under transformers 5.17
# and 5.24, and ``benchmarks/coverage.py`` exact on the dynamic cache under 5.24). Batch 1 on the dynamic cache. The
# text configs' types: LFM2-VL's is lfm2, Qwen3.5's qwen3_5_text. Where Mamba2 mixers bound dt (Zamba2's and
# Nemotron-H's defaults), the forwards after the prompt lift the bound (``step_size.py``, ``ModelSpec``'s
# bounded_step_size).
STATE_SNAPSHOT_EXACT = {"mamba2", "falcon_h1", "bamba", "granitemoehybrid", "nemotron_h", "zamba2", "qwen3_next",
                        "qwen3_5_text", "qwen3_5_moe_text", "olmo_hybrid", "lfm2", "lfm2_moe", "lfm3"}
# Of those, the types whose forward runs with no attention layer at all (a config or an assistant_early_exit view of
# state layers only); the others read the cache length from an attention layer and fail inside transformers, in
# model.generate too (tried on tiny configs under 5.24: LFM2, LFM2-MoE, Qwen3-Next, Qwen3.5, Bamba, OLMo hybrid).
RUNS_WITHOUT_ATTENTION = {"mamba2", "lfm3"}
# Models whose forward over several tokens does not continue a cached state (model_type -> reason).
_RESTARTS_SCAN = ("for a forward of more than one token over a cache, transformers' Mamba mixer runs its selective "
                  "scan from a zero state and never reads the cached SSM state (only one-token steps do), so a "
                  "verification forward over [last token, drafts] would not continue the state")
RESTARTS_STATE = {"mamba": _RESTARTS_SCAN, "falcon_mamba": _RESTARTS_SCAN, "jamba": _RESTARTS_SCAN}
# Config fields that mark state-space or recurrent blocks in models that list no recurrent layer types.
RECURRENT_CONFIG_FIELDS = ("mamba_d_state", "mamba_n_heads", "ssm_state_size", "mamba_d_conv", "conv_L_cache",
                           "lru_width", "linear_attn_config", "block_types", "hybrid_override_pattern",
                           "layers_block_type", "attn_layer_period", "mamba_expand", "linear_key_head_dim",
                           "slstm_block_indices", "state_size", "conv_kernel", "time_step_rank")
# ALiBi models whose bias is computed from a 2-D attention mask (real positions: cumsum of the mask).
ALIBI_FROM_MASK = ("bloom", "falcon")
PATHS = ("dynamic", "static", "compile")
# Architectures whose failure the generic rules above cannot see from the config or the forward's signature, found
# by benchmarks/coverage.py (BLT: by HF's own tester config, which states num_hidden_layers): model_type -> (paths
# refused, reason).
_PROPHETNET = ("once its cache holds a token its decoder takes one token per forward (it asserts decoder_input_ids of "
               "length 1 under use_cache: its n-gram predicting streams are built for that one step) and builds its "
               "own causal and n-gram masks from the 2-D mask, so a verification forward over several drafted tokens "
               "cannot run on its cache")
KNOWN_UNSUPPORTED = {
    "prophetnet": (PATHS, _PROPHETNET),
    "cpmant": (PATHS, "it builds its own attention mask and position bias from the 2-D mask and cache length, and "
                      "does not take the runners' 4-D slot masks"),
    "blt": (PATHS, "its global transformer runs over the patches of each forward's own tokens, with no cache and "
                   "positions from 0, so a forward over several tokens gives other logits than one-token steps "
                   "(byte-latent patches: a verification forward is not the steps of model.generate)"),
    "mimo_v2_flash": (("static", "compile"), "its sliding-window layers have their own K/V head count, which the "
                                             "static cache's per-model buffer shape does not describe"),
}
# Config settings under which a forward reads its cache in a way the runners' masks do not describe (setting ->
# (value, reason)), found by benchmarks/coverage.py.
CONFIG_UNSUPPORTED = {
    "recurrent_kv_cache_mode": ("last_loop", "its earlier recurrent loops read the cached K/V directly and cut their "
                                             "sliding window by cache slots (recurrent_kv_cache_mode='last_loop'), "
                                             "where the runners' slots hold rolled-back holes; 'per_loop' is exact on "
                                             "the dynamic cache"),
}
# transformers classes whose generate() override only routes inputs this library does not take (audio features) to
# GenerationMixin.generate, reviewed in transformers 5.17-5.23; any other override is refused (MusicGen's codebook
# delay pattern, SeamlessM4T's target-language tokens, ...). Granite Speech also switches LoRA adapters when PEFT
# has loaded them, so it is accepted only without them.
GENERATE_ROUTES_INPUTS_ONLY = {"GraniteSpeechForConditionalGeneration", "GraniteSpeechPlusForConditionalGeneration",
                               "Nemotron3_5TranscribeForConditionalGeneration"}
# GenerationMixin's decoding-loop methods: a transformers class overriding one decodes by another loop than the one
# speculative_kernels reproduces (Higgs Audio's _sample reads codebooks from an audio head). Reviewed and harmless
# for generation from token ids: CLVP's _prepare_model_inputs (it only adds conditioning embeddings when given).
LOOP_METHODS = ("_sample", "_get_logits_processor", "_get_stopping_criteria", "_prepare_generation_config", "_prefill",
                "_has_unfinished_sequences", "_prepare_generated_length", "_prepare_model_inputs")
LOOP_OVERRIDES_REVIEWED = {("ClvpForCausalLM", "_prepare_model_inputs")}
# GenerationMixin's per-step methods besides LOOP_METHODS: what model.generate feeds the forward at each step.
STEP_METHODS = ("prepare_inputs_for_generation", "_update_model_kwargs_for_generation")
FOUR_D_ATTENTION = ("sdpa", "eager")
# Encoder-decoder model_type -> how its decoder knows positions ("relative": T5's bias from slot offsets;
# "absolute": a table (BART's learned one, Marian's and Pegasus's sinusoids) read at each row's own positions;
# "absolute_skipping_pads": M2M100's (NLLB's) sinusoids, read past the pad id where the token is not the pad token
# and at the pad id's zero row where it is, as fairseq's make_positions numbers them); "position_ids": a decoder
# that takes decoder_position_ids (T5Gemma's rotary positions), given each row's own; "position_ids_skipping_pads":
# such a decoder whose positions HF numbers from the pad id, skipping pad tokens (RoBERTa inside a wrapper:
# ``wrapped_seq2seq.py``, whose generic wrappers EncoderDecoderModel, VisionEncoderDecoderModel and
# SpeechEncoderDecoderModel take their kind from the decoder they wrap); "computed": sinusoids the position module
# computes from the position ids it is given (Pegasus-X), recomputed at each row's own; "absolute_fsmt": FSMT's
# sinusoid table, read where model.generate's one-token steps read it (pad + 1 + position for a token, pad +
# position for the pad token; transformers before 5.18 (5.17: no cache_length) read pad + 1 and pad at every step),
# through its decoder, called directly: its model forward builds no causal mask when use_cache).
POSITION_KINDS = {"t5": "relative", "mt5": "relative", "bart": "absolute", "mbart": "absolute", "marian": "absolute",
                  "pegasus": "absolute", "blenderbot": "absolute", "blenderbot-small": "absolute",
                  "plbart": "absolute", "mvp": "absolute", "m2m_100": "absolute_skipping_pads", "umt5": "relative",
                  "longt5": "relative", "switch_transformers": "relative", "bigbird_pegasus": "absolute",
                  "t5gemma": "position_ids", "t5gemma2": "position_ids", "pegasus_x": "computed",
                  "fsmt": "absolute_fsmt"}
# Encoder-decoder types whose decoder attends to its own tokens and the source in one attention over the two masks
# concatenated (T5Gemma 2's merged attention): the cross mask must be of the self mask's kind (additive), given also
# where the request has none (transformers' own is bool under sdpa, which concatenated to an additive mask reads as a
# bias of 1 on every source key).
MERGED_ATTENTION = ("t5gemma2",)
# Encoder-decoder types refused with a reason of their own (model_type -> why), reviewed in transformers 5.17-5.24.
SEQ2SEQ_REFUSED = {
    "prophetnet": _PROPHETNET,
    "nllb-moe": "its router reads the decoder attention mask's last row as per-token padding flags (and counts an "
                "expert capacity over the forward's tokens), so a verification forward over several tokens in the "
                "runners' cache layout routes tokens otherwise than model.generate's one-token steps (greedy tokens "
                "differed in a batch of 2)",
    "led": "its decoder drops the attention mask in one-token forwards (it builds one only over several tokens), "
           "so such a forward attends every slot of the cache, where the runners' caches hold slots it must not see "
           "(the static cache's unwritten ones, a batch's alignment slots; measured: another last token on the static "
           "cache)",
}
# The base model keeps a KV cache only as a decoder: ``if self.config.is_decoder: use_cache = ...`` (BERT family) or
# ``if not self.config.is_decoder: use_cache = False`` (BigBird)
_DECODER_ONLY_CACHE = re.compile(r"if (?:not )?self\.config\.is_decoder:\s*\n\s*use_cache")
_DICT_MASK = re.compile(r"isinstance\(\s*(\w+\s*:=\s*)?attention_mask\s*,\s*dict\s*\)")
_DROPS_POSITION_IDS = re.compile(r"""\.pop\(\s*["']position_ids["']""")
# A prepare_inputs_for_generation that appends a token of its own to every step's ids (XLM, Flaubert, XLNet: a mask
# token whose position the next token is read at)
_APPENDS_TO_INPUT_IDS = re.compile(r"input_ids\s*=\s*torch\.cat\(\s*\[\s*input_ids\s*,")
_BIDIRECTIONAL_MASK = re.compile(r"\bcreate_bidirectional_mask\(")
# A decoder stack that adds layers to the cache it is given (Dory: a copy of the recurrent layers' cache per loop).
_GROWS_CACHE_LAYERS = re.compile(r"(?:cache|past_key_values)\.layers\s*(?:\+=|\.append\(|\.extend\()")
# A forward that widens a 2-D mask at one-token steps (GIT in transformers 5.17: ``elif past_key_values is not None
# and seq_len == 1: ... torch.cat([extended_attention_mask, attention_mask], dim=-1)``, whatever the mask's rank).
_WIDENS_2D_MASK_AT_STEPS = re.compile(r"seq_len\s*==\s*1\s*:[\s\S]{0,600}?torch\.cat\(\s*\[\s*extended_attention_mask")
# A decoder stack that flattens every mask it gets to [B, -1] (ImageGPT; GPT-2 and CTRL guard the same line with
# ``ndim < 4``): a 4-D mask over several queries would become a garbled padding mask, so it takes the 2-D one.
_FLATTENS_ANY_MASK = re.compile(r"if attention_mask is not None:\s*\n\s*attention_mask = attention_mask\.view\(")
# A forward that widens a 2-D mask once a cache holds slots (GIT from transformers 5.18: ``elif cache is not None and
# cache_length > 0 and attention_mask is not None and attention_mask.ndim == 2: ... torch.cat([extended_attention_mask,
# attention_mask])``; the condition is on one line from 5.24, in parentheses over several lines in 5.18-5.23) by the
# image tokens, which a text-only cache does not hold: the widened mask no longer lines up with the cache, so
# model.generate's one-token steps attend to a padded row's masked slots. The 4-D masks of the speculative forwards
# are not widened: exact where the mask masks nothing (``check_masked_slots``).
_WIDENS_2D_MASK_OVER_CACHE = re.compile(r"attention_mask\.ndim\s*==\s*2[\s)]*:[\s\S]{0,600}?torch\.cat\(\s*\[\s*"
                                        r"extended_attention_mask")


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """How a runner drives one model.

    mask: "4d" (one additive [B, 1, T, S] mask), "4d-by-layer-type" (a dict of them keyed by layer type), "2d"
    (the slot mask [B, S]: ALiBi models build their bias and causal mask from it; attention kernels that take no 4-D
    mask get it too) or "none" (``recurrent``).
    sliding_window: the window (in positions) of the sliding layers, applied by the mask; None: no sliding layers.
    positions: encoder-decoder models only, how the decoder knows positions (a ``POSITION_KINDS`` value); None for
    decoder-only models, which take position ids.
    kv_sizes: (kv_heads, key_head_dim, value_head_dim) of each layer's (decoder self-attention) K/V as the model
    writes them to its cache, None for a layer without a cache of its own (``CACHELESS_LAYERS``: a KV-sharing
    consumer), read on the static paths, which preallocate them; None on the dynamic path. Keys and values differ in
    head size where multi-head latent attention caches its latents (``_caches_latents``), layers where a heterogeneous
    config (per_layer_config) sizes each layer.
    cache_argument: the forward's keyword for the KV cache, and the output's field that returns it
    ("past_key_values" up to transformers 5.23, "cache" from 5.24: ``cache_argument``).
    window_applied: False where HF's cache keeps the sliding window but the model's attention does not apply it
    (``_applies_window``): exact only for requests the window spans (``check_window_applied``).
    masked_slots_exact: False where model.generate's steps do not mask what the attention mask masks (GIT,
    ``_WIDENS_2D_MASK_OVER_CACHE``): exact only for masks without zeros (``check_masked_slots``).
    forward_flags: keywords every forward of the runner passes (``forward_flags``).
    recurrent: the model keeps conv/recurrent states (``STATE_SNAPSHOT_EXACT``), driven by
    ``runners.recurrent.RecurrentRunner`` at batch 1 (mask "none": it gets no attention mask, as a one-row prompt
    without padding needs none).
    bounded_step_size: its Mamba2 mixers clamp dt to a bounded ``time_step_limit`` in a forward over several tokens
    and not in a one-token step (``step_size.py``): the recurrent runner lifts the limit on every forward after the
    prompt, and a target's first token comes from its forward over the whole prompt, as model.generate's.
    prompt_remainder_first: bounded_step_size without an attention layer (Mamba2 with a bounded time_step_limit):
    transformers' own chunked prefill fails on such a model, so model.generate's unchunked prefill is the reference
    for ``prefill_chunk_size``, and a prompt chunk of one token after the first would run the unclamped step; the
    short chunk runs first instead (``runners.prefill``). Hybrids (Zamba2, Nemotron-H) keep HF's order, as their
    model.generate runs its own chunks (a one-token last chunk takes the step there too).
    """

    architecture: str
    mask: str = "4d"
    sliding_window: int | None = None
    positions: str | None = None
    kv_sizes: tuple[tuple[int, int, int] | None, ...] | None = None
    cache_argument: str = "past_key_values"
    window_applied: bool = True
    masked_slots_exact: bool = True
    forward_flags: tuple[tuple[str, object], ...] = ()
    recurrent: bool = False
    bounded_step_size: bool = False
    prompt_remainder_first: bool = False

    @property
    def encoder_decoder(self) -> bool:
        return self.positions is not None


def _refuse(name: str, path: str, reason: str):
    where = {"dynamic": "", "static": " with cache_implementation='static'", "compile": " with compile=True"}[path]
    raise ValueError(f"{name} cannot be driven exactly by speculative_kernels{where}: {reason}")


def _parameters(model) -> set:
    """The keywords ``model.forward`` takes. A forward that hides them (only *args/**kwargs: a wrapper set on the
    instance, ``model.forward = lambda *a, **k: ...`` without functools.wraps, or a user's subclass overriding
    ``forward(self, *args, **kwargs)`` to call ``super().forward`` and change its output) passes them on to the next
    forward of the class's MRO, whose keywords are read instead (HF's generate drives such a model the same way)."""
    forwards = [model.forward, *(vars(klass)["forward"] for klass in type(model).__mro__ if "forward" in vars(klass))]
    for forward in forwards:
        parameters = inspect.signature(forward).parameters
        if not _passes_everything_on(parameters):
            break
    return set(parameters)


def _passes_everything_on(parameters) -> bool:
    """Whether a signature takes only *args/**kwargs (a wrapper or an override that calls ``super().forward``)."""
    kinds = {p.kind for name, p in parameters.items() if name != "self"}
    return bool(kinds) and kinds <= {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD}


# The forward's keyword for a KV cache: transformers 5.24 renamed ``past_key_values`` (and mamba's ``cache_params``)
# to ``cache`` in every model's forward and output; the old name still works there through a deprecation shim that
# warns. Looked up in this order, so a model that still declares the old name is driven by it.
CACHE_ARGUMENTS = ("past_key_values", "cache")


def cache_argument(model) -> str | None:
    """The keyword ``model.forward`` takes its KV cache by (and the output field it returns it in), or None."""
    params = _parameters(model)
    return next((name for name in CACHE_ARGUMENTS if name in params), None)


def layer_types(config) -> tuple[list[str], list[int | None]] | None:
    """(layer type per cache layer, sliding window per layer) as HF's ``DynamicCache(config=...)`` reads them, in
    every transformers 5.x (5.17 and 5.18 return one kwargs dict, later versions one per layer); None for a config that
    states neither (e.g. BLT's, whose layers live in sub-configs)."""
    try:
        from transformers.cache_utils import get_layer_types_and_kwargs
    except ImportError:  # older layouts: read the config
        get_layer_types_and_kwargs = None
    if get_layer_types_and_kwargs is not None:
        try:
            types, kwargs = get_layer_types_and_kwargs(config)
        except Exception:  # noqa: BLE001 -- configs HF's own helper cannot read: fall back to the plain fields
            types, kwargs = None, None
        if types is not None:
            per_layer = kwargs if isinstance(kwargs, list) else [kwargs] * len(types)
            return list(types), [k.get("sliding_window") for k in per_layer]
    types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None)
    if types is None:
        layers = getattr(config, "num_hidden_layers", None)
        if layers is None:
            return None
        types = ["sliding_attention" if window is not None else "full_attention"] * layers
    return list(types), [window if t == "sliding_attention" else None for t in types]


def _state_model_type(config) -> bool:
    """Whether the model type is one whose recurrent states are rolled back (``STATE_SNAPSHOT_EXACT``) or refused for
    a reason of its own (``RESTARTS_STATE``)."""
    return getattr(config, "model_type", "") in STATE_SNAPSHOT_EXACT | set(RESTARTS_STATE)


def _recurrent_spec(model, name: str, config, path: str, batch: int, types: list[str],
                    cache_arg: str) -> ModelSpec:
    """The spec of a model with recurrent states (``STATE_SNAPSHOT_EXACT``), or its refusal by name: a model whose
    forward over several tokens restarts its state, one reading the cache length where no layer holds attention
    K/V, another path than the dynamic cache, a batch."""
    kinds = sorted(set(types) & STATE_LAYERS)
    unknown = sorted(set(types) - ATTENTION_LAYERS - CACHELESS_LAYERS - STATE_LAYERS)
    what = (f"it has {kinds} layers (a conv/recurrent state that folds in every token)" if kinds else
            "it keeps conv/recurrent states (which fold in every token)")
    restarts = RESTARTS_STATE.get(getattr(config, "model_type", ""))
    if restarts:
        _refuse(name, path, f"{what}: {restarts}")
    if unknown or "sliding_attention" in types:
        _refuse(name, path, f"{what} beside layers of type {unknown or ['sliding_attention']}, whose rollback beside "
                            "a restored state is not supported")
    attention = set(types) & (ATTENTION_LAYERS | {"hybrid"})
    if not attention and getattr(config, "model_type", "") not in RUNS_WITHOUT_ATTENTION:
        _refuse(name, path, f"{what} and no attention layer, and its forward reads the cache length from one "
                            "(cache.get_seq_length(), for its attention mask: transformers fails, in model.generate "
                            "too; e.g. an assistant_early_exit view of its first linear-attention layers)")
    if path != "dynamic":
        _refuse(name, path, f"{what}: its state is rolled back by a snapshot and a re-run of the accepted tokens, on "
                            "HF's dynamic cache only (the static cache holds attention K/V slots); use the dynamic "
                            "cache")
    if batch > 1:
        _refuse(name, path, f"{what}: its state is rolled back by a snapshot and a re-run of the accepted tokens, at "
                            "batch size 1 only (in a batch, left padding and each row's own accepted count reach the "
                            "state); decode the prompts one at a time")
    bounded = bool(bounded_mixers(model))
    return ModelSpec(name, mask="none", cache_argument=cache_arg, recurrent=True, bounded_step_size=bounded,
                     prompt_remainder_first=bounded and not attention)


def _recurrent_reason(model, config) -> str | None:
    name = type(model).__name__
    cache_kind = getattr(model, "_supports_default_dynamic_cache", None)
    if callable(cache_kind) and not cache_kind():
        return "it keeps a recurrent or custom cache that HF's DynamicCache cannot hold"
    if getattr(model, "_is_stateful", False):
        return "it is stateful (recurrent or conv/SSM state), and a state cannot be rolled back per token"
    fields = [f for f in RECURRENT_CONFIG_FIELDS if getattr(config, f, None) not in (None, [], ())]
    if fields and name:
        return (f"its config describes recurrent or state-space blocks ({', '.join(fields)}): their state folds in "
                "every token, so a rejected draft cannot be removed from it, and left padding reaches it")
    return None


# Forward arguments of drafters that run on the target's internal states rather than on token ids: Gemma 4's
# assistants (shared_kv_states, with the target's last hidden state as inputs_embeds: transformers'
# SinglePositionMultiTokenCandidateGenerator) and DFlash drafts (context_hidden_states from chosen target layers).
TARGET_STATE_ARGUMENTS = ("shared_kv_states", "context_hidden_states", "target_hidden_states")


def _step_size_clamp_reason(model) -> str | None:
    """Why a target whose Mamba2-style mixers bound the SSM step size dt cannot be verified exactly, or None.

    transformers' Mamba2 mixers clamp dt to ``time_step_limit`` in their chunked scan (a forward over several tokens)
    and not in their one-token step, which model.generate runs for every token after the prompt (Zamba2's and
    Nemotron-H's limit is (time_step_min, inf); the others read config.time_step_limit, (0, inf) by default). Such a
    target is exact (``step_size.py``: the prompt's forwards clamp, as model.generate's prefill; the recurrent runner
    lifts the limit on every later forward), except where the lift cannot reach the scan: a mixer that does not read
    ``self.time_step_limit`` (an instance attribute) when it runs, or one in a model the recurrent runner does not
    drive. A draft is never refused (only the target's forwards must match model.generate's)."""
    mixers = bounded_mixers(model)
    if not mixers:
        return None
    unread = unread_limit_classes(mixers)
    if unread:
        how = (f"its mixers ({', '.join(unread)}) do not pass dt_limit=self.time_step_limit (an attribute of "
               "each instance) to their scan as transformers 5.17-5.24's do, so the verification forwards cannot "
               "lift the limit")
    elif not _state_model_type(model.config.get_text_config(decoder=True)):
        how = ("the limit is lifted on the forwards after the prompt by the recurrent runner, which drives the model "
               f"types {sorted(STATE_SNAPSHOT_EXACT)} only")
    else:
        return None
    return (f"its Mamba2 mixers clamp the SSM step size dt to time_step_limit={bounds_shown(mixers)} in a forward "
            "over several tokens (the chunked scan) but not in the one-token step that model.generate takes after "
            f"the prompt, and {how} (such a model can be a draft_model)")


def _target_state_reason(params: set) -> str | None:
    needed = sorted(set(TARGET_STATE_ARGUMENTS) & params)
    if not needed:
        return None
    return (f"it is an assistant that drafts from another model's internal states (its forward takes "
            f"{', '.join(needed)}), not a language model over token ids: it can be neither a target nor a "
            "draft_model here. Draft with a small causal LM sharing the target's vocabulary, with "
            "prompt_lookup_num_tokens, or with a Drafter of your own")


def _four_d_masks(model, name: str, path: str) -> bool:
    """Whether the model's attention takes the explicit 4-D masks the runners build ('sdpa', 'eager', or an
    implementation registered with one of their mask functions), else the 2-D mask its own mask function expands
    (flash, flex). An implementation with no mask function in transformers (a custom one registered only with
    AttentionInterface, 'paged|eager') gets no mask at all from the model, so a verification forward over several
    tokens would run unmasked (top-left causal over the cache, padding ignored): refused by name."""
    attention = getattr(model.config, "_attn_implementation", None)
    if attention is None or attention in FOUR_D_ATTENTION:
        return attention is not None
    try:
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS as mask_functions
    except ImportError:  # (every supported transformers has it)
        return False
    try:
        mask_function = mask_functions[attention]
    except KeyError:
        _refuse(name, path, f"attn_implementation={attention!r} has no mask function in transformers (none registered "
                            "with AttentionMaskInterface), so a forward over several new tokens would run without "
                            "a causal or padding mask; use 'sdpa' or 'eager', or register the mask function your "
                            "attention takes (e.g. AttentionMaskInterface.register(name, sdpa_mask))")
    return any(mask_function is mask_functions[known] for known in FOUR_D_ATTENTION if known in mask_functions)


def _check_decoder_only(model, path: str, batch: int) -> ModelSpec:
    name = type(model).__name__
    config = model.config.get_text_config(decoder=True)
    params = _parameters(model)
    reason = _target_state_reason(params)
    if reason:
        _refuse(name, path, reason)
    cache_arg = cache_argument(model)
    if cache_arg is None and "cache_params" in params and _state_model_type(config):
        cache_arg = "cache_params"  # (Mamba's and Mamba2's keyword up to transformers 5.23, a DynamicCache there too)
    for arg, present in (("past_key_values or cache", cache_arg is not None),
                         ("attention_mask", "attention_mask" in params)):
        if not present:
            _refuse(name, path, f"its forward takes no {arg} (a cache-less or recurrent model); speculative "
                                "decoding needs a KV cache it can roll back")
    if not getattr(config, "is_decoder", True) and _source_matches(model, _DECODER_ONLY_CACHE):
        _refuse(name, path, "config.is_decoder is False, so it runs as a bidirectional encoder without a KV cache; "
                            "set is_decoder=True to generate with it")
    layout = layer_types(config)
    if layout is None:
        _refuse(name, path, f"its config ({type(config).__name__}) states neither layer_types nor "
                            "num_hidden_layers, so its cache layout cannot be checked")
    types, windows = layout
    if _state_model_type(config):
        return _recurrent_spec(model, name, config, path, batch, types, cache_arg)
    unknown = sorted(set(types) - ATTENTION_LAYERS - CACHELESS_LAYERS)
    if unknown:
        recurrent = sorted(set(unknown) & RECURRENT_LAYERS)
        if recurrent:
            _refuse(name, path, f"it has {recurrent} layers: a conv/recurrent state folds in every token, so a "
                                "rejected draft cannot be removed from it, and left padding reaches it")
        if "chunked_attention" in unknown:
            _refuse(name, path, "chunked attention is not supported (its chunks follow HF's cache slots)")
        _refuse(name, path, f"it has cache layers of type {unknown}, which cannot be rolled back slot by slot")
    reason = _recurrent_reason(model, config)
    if reason:
        _refuse(name, path, reason)
    for setting, (value, why) in CONFIG_UNSUPPORTED.items():
        if getattr(config, setting, None) == value:
            _refuse(name, path, why)
    if path != "dynamic" and _GROWS_CACHE_LAYERS.search(_decoder_stack_source(model)[1]):
        _refuse(name, path, "its forward adds layers of its own to the cache (e.g. one per recurrent loop), which the "
                            "static cache's preallocated per-layer buffers and shared write pointer do not hold; use "
                            "the dynamic cache")
    known = KNOWN_UNSUPPORTED.get(getattr(config, "model_type", ""))
    if known and path in known[0]:
        _refuse(name, path, known[1])
    layout = _static_layout_reason(model, config) if path != "dynamic" else None
    if layout:
        _refuse(name, path, layout)
    sizes = None
    if path != "dynamic":
        try:
            sizes = _config_kv_sizes(name, model, config)
        except Exception as error:  # noqa: BLE001 -- e.g. a config that refuses a global head_dim
            _refuse(name, path, f"the static cache cannot size its K/V buffers from the config ({error})")
        # layers without a cache of their own (KV-sharing consumers, MoE/MLP-only layers): no buffers
        sizes = tuple(None if i < len(types) and types[i] in CACHELESS_LAYERS else size
                      for i, size in enumerate(sizes))
        if None in sizes and not hasattr(transformers.cache_utils, "DummyLayer"):
            _refuse(name, path, f"its layers of type {sorted(set(types) & CACHELESS_LAYERS)} have no cache of their "
                                f"own, and transformers {transformers.__version__} has no cache layer for them "
                                "(DummyLayer, in later versions); use the dynamic cache")
    attention = getattr(model.config, "_attn_implementation", None)
    four_d = _four_d_masks(model, name, path)
    flattens = four_d and bool(_FLATTENS_ANY_MASK.search(_decoder_stack_source(model)[1]))
    four_d = four_d and not flattens
    own_mask = _own_mask_code(model) if four_d and path == "dynamic" else None
    four_d = four_d and own_mask is None
    model_type = getattr(config, "model_type", "")
    alibi = model_type in ALIBI_FROM_MASK and (model_type == "bloom" or bool(getattr(config, "alibi", False)))
    alibi_slots = model_type == "mpt" or "alibi" in model_type  # (HF's MPT applies ALiBi whatever attn_config says)
    if path != "dynamic" and flattens:
        _refuse(name, path, "its forward flattens any attention mask to [batch, -1], so it takes no 4-D mask; the "
                            "static cache passes explicit 4-D masks (the dynamic cache drives it with the 2-D one)")
    if path != "dynamic" and not four_d:
        _refuse(name, path, f"attn_implementation={attention!r} takes no 4-D mask; the static cache passes explicit "
                            f"4-D masks, which only {FOUR_D_ATTENTION} take")
    sliding = {w for t, w in zip(types, windows) if t == "sliding_attention"}
    window = None
    if sliding:
        if len(sliding) > 1 or None in sliding:
            _refuse(name, path, f"its sliding-window layers have different windows {sorted(map(str, sliding))}")
        window = int(sliding.pop())
        window_applied = _applies_window(model, types)
        if own_mask is not None:
            _refuse(name, path, f"sliding-window layers are applied through 4-D masks, and {own_mask} is not "
                                "transformers' code, so it is given the 2-D mask model.generate gives it")
        if not four_d:
            _refuse(name, path, f"sliding-window layers are applied through 4-D masks, which "
                                f"attn_implementation={attention!r} does not take; use 'sdpa' or 'eager'")
    mixed = window is not None and "full_attention" in types
    if mixed and not _takes_mask_dict(model):
        _refuse(name, path, "it mixes full and sliding-window layers but takes a single attention mask")
    if alibi:
        if window is not None:
            _refuse(name, path, "ALiBi together with sliding windows is not supported")
        return ModelSpec(name, mask="2d", kv_sizes=sizes, cache_argument=cache_arg)
    if batch > 1 and ("position_ids" not in params or alibi_slots):
        why = "ALiBi from key slot indices" if alibi_slots else "its forward takes no position_ids"
        _refuse(name, path, f"it derives positions from cache slots ({why}); rejected drafts leave holes in a batch, "
                            "so only batch size 1 is exact")
    scaled = _scales_by_cache_length(model)
    if batch > 1 and scaled:
        _refuse(name, path, f"{scaled} scales its queries by the cache's length (cache.get_seq_length(), Llama 4's "
                            "attention temperature tuning on its NoPE layers), not by position; rejected drafts leave "
                            "holes in a batch, so only batch size 1 is exact")
    slot_window = _slot_window(config)
    if slot_window is not None and (batch > 1 or path != "dynamic"):
        _refuse(name, path, f"its local attention layers apply window_size={slot_window} over cache slots (a causal "
                            "buffer indexed by the slot, not a mask over positions): rejected drafts leave holes in a "
                            "batch, and the static cache lays out its slots its own way, so only batch size 1 on the "
                            "dynamic cache is exact")
    if not four_d:  # (dynamic path, no sliding layers) flash/flex attention: the 2-D mask
        return ModelSpec(name, mask="2d", kv_sizes=sizes, cache_argument=cache_arg)
    return ModelSpec(name, mask="4d-by-layer-type" if mixed else "4d", sliding_window=window, kv_sizes=sizes,
                     cache_argument=cache_arg, window_applied=window is None or window_applied)


# An attention forward that reads its layer's cache length (Llama 4's NoPE layers with attention temperature tuning:
# ``positions = arange(q_len) + cache.get_seq_length(self.layer_idx)``).
_CACHE_LENGTH_IN_ATTENTION = re.compile(r"get_seq_length\(\s*self\.layer_idx")


@functools.cache
def _reads_cache_length(forward) -> bool:
    return bool(_CACHE_LENGTH_IN_ATTENTION.search(_source(forward)))


def _own_forward(module) -> str | None:
    """"Class.forward" where ``module``'s forward is not transformers' code (remote code loaded with
    trust_remote_code, a user's own model or subclass), or None."""
    owner = next((klass for klass in type(module).__mro__ if "forward" in vars(klass)), None)
    if owner is None or owner.__module__.startswith("transformers."):
        return None
    return f"{owner.__name__}.forward"


def _own_mask_code(model) -> str | None:
    """``_own_forward`` of the decoder stack (the forward that turns the attention mask into the attention's bias).
    Such a forward may build its causal and padding mask from a 2-D mask whatever it is given (as pre-2024 remote
    code does: a 4-D mask there gave other tokens at batch 1 and crashed in a batch), and 'eager' says nothing about
    it (it is the default attn_implementation of remote code). On the dynamic cache it is given the 2-D slot mask
    [B, S], as model.generate gives it its 2-D mask: causal over the cache's slots, holes masked as padding,
    positions passed explicitly."""
    return _own_forward(_decoder_stack_source(model)[0])


def _own_forward_contract_reason(model, cache_arg: str) -> str | None:
    """Why a forward that is not transformers' code (remote code, a user's model or subclass) cannot be driven, or
    None: one 1-token forward, given a transformers ``DynamicCache`` as the runners give theirs, must take it and
    return a ModelOutput with logits and a transformers ``Cache``. Remote code written for legacy caches (tuples of
    (key, value) per layer) fails inside its own forward on a Cache ("not subscriptable"), and some return tuples
    whatever return_dict says: both failed inside the runners' first forward (model.generate fails as well, or, in
    transformers 5.24, recomputes every step without a cache). Offloaded weights (meta) are not probed."""
    from transformers import DynamicCache
    from transformers.cache_utils import Cache
    from transformers.utils import ModelOutput

    code = _own_forward(model) or _own_mask_code(model)
    parameter = next(model.parameters(), None)
    if code is None or parameter is None or parameter.device.type == "meta":
        return None
    ids = torch.zeros(1, 1, dtype=torch.int64, device=parameter.device)
    try:
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=torch.ones_like(ids), position_ids=torch.zeros_like(ids),
                        use_cache=True, return_dict=True, **{cache_arg: DynamicCache()})
    except Exception as error:  # noqa: BLE001 -- the model's own code: its failure is the reason, named
        return (f"{code} fails when given a transformers Cache as {cache_arg} ({type(error).__name__}: {error}); "
                "speculative decoding passes its own Cache to every forward (legacy caches, tuples of (key, value) "
                "per layer, are not supported)")
    if not isinstance(out, ModelOutput) or not isinstance(out.get("logits"), torch.Tensor):
        return (f"{code} returns a {type(out).__name__}, not a ModelOutput with logits, when called with "
                "return_dict=True (as model.generate calls it)")
    returned = out.get(cache_arg)
    if not isinstance(returned, Cache):
        return (f"{code} returns its cache ({cache_arg}) as a {type(returned).__name__}, not a transformers Cache "
                "(a legacy cache of (key, value) tuples?); speculative decoding needs the Cache it passes")
    return None


def _scales_by_cache_length(model) -> str | None:
    """The class name of an attention module whose forward reads its layer's cache length as the position of its
    queries, or None. At batch 1 our rolled-back cache holds as many slots as HF's, so the length is the position;
    in a batch, rejected drafts leave holes, so a row's length runs ahead of its position. Llama 4 reads it so on
    NoPE layers (``use_rope`` False) with ``attn_temperature_tuning``; other attention modules read the length for
    other purposes (BigBird: whether cross-attention K/V are cached), so only that setting counts."""
    for module in model.modules():
        if (getattr(module, "attn_temperature_tuning", False) and not getattr(module, "use_rope", True)
                and _reads_cache_length(type(module).forward)):
            return type(module).__name__
    return None


def _input_id_positions_reason(model) -> str | None:
    """Why a decoder whose forward takes no ``position_ids`` and derives them from the input ids is ruled out, or
    None: fairseq's rule (``create_position_ids_from_input_ids``: pad ids get no position of their own, later tokens
    one less each; TrOCR with ``use_learned_position_embeddings=False``). In a one-token step a pad id's slot still
    counts (the cache length), in a forward over several tokens it does not, so a pad id in the prompt or among the
    verified tokens (the model can generate it) shifts every later position."""
    if "position_ids" in _parameters(model):
        return None
    for module in model.modules():
        if "create_position_ids_from_input_ids" in vars(type(module)) and \
                type(module).__module__.startswith("transformers.models."):
            return (f"its {type(module).__name__} derives positions from the input ids, skipping pad ids "
                    "(create_position_ids_from_input_ids), and its forward takes no position_ids: a pad id in a "
                    "forward over several tokens shifts every later position, unlike in a one-token step")
    return None


def _slot_window(config) -> int | None:
    """The window of layers that apply it by cache slot rather than through the mask (GPT-Neo's "local" layers:
    ``config.attention_layers`` with ``window_size``, a causal buffer indexed by slot), or None. HF's
    ``layer_types`` does not describe them: they read as full attention."""
    layers = getattr(config, "attention_layers", None)
    window = getattr(config, "window_size", None)
    if isinstance(layers, (list, tuple)) and "local" in layers and isinstance(window, int):
        return window
    return None


# Mask builders through which transformers' decoder stacks apply a sliding window (``create_sliding_window_causal_mask``,
# the layer-type mask dicts, ``sliding_window_causal_mask_function``, ...): their forwards name it.
_APPLIES_WINDOW = re.compile(r"sliding")


def _applies_window(model, types: list[str]) -> bool:
    """Whether the model's attention applies the sliding window that HF's ``DynamicCache(config=...)`` keeps for the
    layers ``types`` marks "sliding_attention". Not where an attention module of such a layer states
    ``sliding_window = None`` (Qwen3-Omni's thinker ignores the config's window), nor where no forward of the decoder
    stack (the model, its base model, its decoder and their language/text models) builds a sliding-window mask: a
    ``config.sliding_window`` on a model without windows (Llama, Moshi) is read by the cache alone."""
    stacks = [model, getattr(model, "base_model", None)]
    decoder = model.get_decoder() if callable(getattr(model, "get_decoder", None)) else None
    stacks.append(decoder if isinstance(decoder, torch.nn.Module) else None)
    for module in list(stacks):
        for name in ("language_model", "model", "text_model"):
            inner = getattr(module, name, None) if module is not None else None
            stacks.append(inner if isinstance(inner, torch.nn.Module) else None)
    if not any(_APPLIES_WINDOW.search(_source(type(m).forward)) for m in stacks if m is not None):
        return False
    windows = {}
    for module in (decoder if isinstance(decoder, torch.nn.Module) else model).modules():
        index = getattr(module, "layer_idx", None)
        if isinstance(index, int) and "sliding_window" in vars(module):
            windows.setdefault(index, module.sliding_window)
    return not any(kind == "sliding_attention" and windows.get(i, 0) is None for i, kind in enumerate(types))


def _config_kv_sizes(name: str, model, config) -> tuple[tuple[int, int, int], ...]:
    """(kv_heads, key_head_dim, value_head_dim) of each layer's K/V as a decoder-only model's attention writes them
    to its cache, from its config (``ModelSpec.kv_sizes``), or ValueError when it does not say. A heterogeneous config
    (per_layer_config) states them per layer."""
    layers = getattr(config, "num_hidden_layers", None)
    if not layers:
        raise ValueError(f"{name}: the static cache cannot size its K/V buffers from the config "
                         f"(num_hidden_layers={layers}); use the dynamic cache")
    if getattr(config, "kv_lora_rank", None):  # (the latents: ``_caches_latents``, checked first)
        return ((1, int(config.kv_lora_rank), int(config.qk_rope_head_dim)),) * int(layers)
    if getattr(config, "is_heterogeneous", False):
        return tuple(_layer_kv_sizes(name, layer) for layer in config.per_layer_config)
    return (_layer_kv_sizes(name, config),) * int(layers)


def _layer_kv_sizes(name: str, config) -> tuple[int, int, int]:
    """(kv_heads, head_dim, head_dim) of one layer's (or every layer's) config."""
    heads = getattr(config, "num_attention_heads", None)
    hidden = getattr(config, "hidden_size", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if getattr(config, "model_type", "") == "falcon":
        kv_heads = _falcon_kv_heads(config)
    head_dim = getattr(config, "head_dim", None) or (hidden // heads if heads and hidden else None)
    if not (kv_heads and head_dim):
        raise ValueError(
            f"{name}: the static cache cannot size its K/V buffers from the config (num_key_value_heads={kv_heads}, "
            f"head_dim={head_dim}); use the dynamic cache"
        )
    return int(kv_heads), int(head_dim), int(head_dim)


def _falcon_kv_heads(config) -> int:
    """The K/V heads Falcon's attention caches: all of its query heads with new_decoder_architecture (it broadcasts
    its num_kv_heads groups to them before the cache), one with multi_query, else num_kv_heads."""
    if getattr(config, "new_decoder_architecture", False):
        return config.num_attention_heads
    return 1 if getattr(config, "multi_query", False) else config.num_kv_heads


# Multi-head latent attention (config.kv_lora_rank: DeepSeek-V2/V3 and the models built like them) writes its cache
# before expanding its latents to per-head K/V (``cache.update(...)`` before ``self.expand_kv(...)``, in every MLA
# model of transformers 5.17 and 5.24 but 5.17's sparse-attention ones, refused for their indexer cache): keys
# [B, 1, T, kv_lora_rank], the normalised latent, and values [B, 1, T, qk_rope_head_dim], the rotated shared key.
_CACHE_UPDATE = re.compile(r"\.update\(")
_EXPAND_KV = re.compile(r"\bself\.expand_kv\(")


def _latent_attention(model):
    """The first multi-head latent attention module of ``model`` (one with ``kv_a_proj_with_mqa``), or None."""
    return next((m for m in model.modules() if hasattr(m, "kv_a_proj_with_mqa")), None)


def _caches_latents(model) -> bool:
    """Whether the model's MLA forward writes its latents to the cache (``_CACHE_UPDATE``), read from its source."""
    attention = _latent_attention(model)
    source = _source(type(attention).forward) if attention is not None else ""
    update, expand = _CACHE_UPDATE.search(source), _EXPAND_KV.search(source)
    return update is not None and expand is not None and update.start() < expand.start()


@functools.cache
def _source(function) -> str:
    """The source of a (transformers) function, "" where there is none to read; read once per function (about a
    millisecond each: the checks run on every request)."""
    try:
        return inspect.getsource(function)
    except (OSError, TypeError):
        return ""


def _source_matches(model, pattern: re.Pattern) -> bool:
    """Whether the forward of the model or of its base (decoder stack) matches ``pattern``."""
    return any(module is not None and pattern.search(_source(type(module).forward))
               for module in (getattr(model, "base_model", None), model))


def _takes_mask_dict(model) -> bool:
    """Whether the decoder stack accepts a dict of masks keyed by layer type (HF's hybrid-attention models)."""
    return _source_matches(model, _DICT_MASK)


def _static_layout_reason(model, config) -> str | None:
    """Why the static cache's K/V buffers, sized from the config (``_config_kv_sizes``), would not fit the model's
    K/V."""
    if getattr(config, "kv_lora_rank", None) and not _caches_latents(model):
        return ("its multi-head latent attention (config.kv_lora_rank) does not write its latents to the cache "
                "before expand_kv (as transformers' MLA models do), so the static cache cannot size its K/V buffers")
    decoder_heads = getattr(config, "decoder_attention_heads", None)
    if decoder_heads is not None and decoder_heads != getattr(config, "num_attention_heads", decoder_heads):
        # e.g. WhisperForCausalLM: num_attention_heads / num_key_value_heads map to the encoder's heads
        return (f"its decoder has {decoder_heads} attention heads where the config's num_attention_heads (the "
                f"encoder's) says {config.num_attention_heads}, so the static cache cannot size its K/V from it")
    return None


def position_kind(model, name: str = "model") -> str:
    """How an encoder-decoder model's decoder knows positions (``POSITION_KINDS``), or ValueError for other types."""
    model_type = getattr(model.config, "model_type", None)
    if is_wrapper(model):
        return wrapped_position_kind(model, name)
    if model_type in SEQ2SEQ_REFUSED:
        raise ValueError(f"{name} is an encoder-decoder model of type {model_type!r} ({type(model).__name__}), which "
                         f"speculative_kernels does not support: {SEQ2SEQ_REFUSED[model_type]}")
    if model_type not in POSITION_KINDS:
        raise ValueError(
            f"{name} is an encoder-decoder model of type {model_type!r} ({type(model).__name__}), which "
            f"speculative_kernels does not support; supported encoder-decoder types: {sorted(POSITION_KINDS)} and "
            "the generic wrappers (encoder-decoder, vision-encoder-decoder, speech-encoder-decoder) of some decoders"
        )
    return POSITION_KINDS[model_type]


def check_pair(model, draft_model) -> None:
    """ValueError unless target and draft are both decoder-only, or both encoder-decoders of a supported type."""
    target_seq2seq, draft_seq2seq = model.config.is_encoder_decoder, draft_model.config.is_encoder_decoder
    if target_seq2seq != draft_seq2seq:
        kinds = {True: "an encoder-decoder", False: "a decoder-only"}
        raise ValueError(
            f"model is {kinds[target_seq2seq]} model but draft_model is {kinds[draft_seq2seq]} model; the draft must "
            "condition on the same input as the target, so both must be encoder-decoder or both decoder-only"
        )
    if target_seq2seq:
        for name, m in (("model", model), ("draft_model", draft_model)):
            position_kind(m, name)
        inputs = [encoder_input_name(m) for m in (model, draft_model)]
        if inputs[0] != inputs[1]:
            raise ValueError(f"model's encoder reads {inputs[0]} but draft_model's reads {inputs[1]}: the draft must "
                             "condition on the same input as the target")


def _decoder_kv_sizes(model, positions: str) -> tuple[tuple[int, int, int], ...]:
    """The decoder self-attention's (kv_heads, key_head_dim, value_head_dim) per layer, read from the modules (a T5
    config's head count times d_kv need not be d_model, and its layer count is the encoder's)."""
    if is_wrapper(model):
        return decoder_kv_sizes(model)
    decoder = model.get_decoder()
    if positions == "relative":  # T5-like
        attention = decoder.block[0].layer[0].SelfAttention
        return ((attention.n_heads, attention.key_value_proj_dim, attention.key_value_proj_dim),) * len(decoder.block)
    if positions == "position_ids":  # T5Gemma: grouped-query attention, sizes in the decoder's config
        attention = decoder.layers[0].self_attn
        heads = attention.config.num_key_value_heads
        return ((heads, attention.head_dim, attention.head_dim),) * len(decoder.layers)
    attention = decoder.layers[0].self_attn  # BART-like, M2M100
    return ((attention.num_heads, attention.head_dim, attention.head_dim),) * len(decoder.layers)


def _check_encoder_decoder(model, path: str) -> ModelSpec:
    name = type(model).__name__
    if not callable(getattr(model, "get_encoder", None)) or model.get_encoder() is None:
        _refuse(name, path, "its config is encoder-decoder but the model has no encoder")
    positions = position_kind(model)  # ValueError naming unsupported encoder-decoder types
    attention = getattr(model.config, "_attn_implementation", None)
    four_d = _four_d_masks(model, name, path)
    if path != "dynamic" and not four_d:
        _refuse(name, path, f"attn_implementation={attention!r} takes no 4-D mask; use 'sdpa' or 'eager'")
    sizes = _decoder_kv_sizes(model, positions) if path != "dynamic" else None
    cache_arg = cache_argument(model)
    if cache_arg is None:
        _refuse(name, path, "its forward takes no past_key_values (or cache): speculative decoding needs a KV cache "
                            "it can roll back")
    window = _decoder_window(model)
    if window is not None and not four_d:
        _refuse(name, path, f"its decoder has sliding-window layers, whose window the runners apply through 4-D masks, "
                            f"which attn_implementation={attention!r} does not take; use 'sdpa' or 'eager'")
    mask = "4d-by-layer-type" if window is not None else "4d" if four_d else "2d"
    return ModelSpec(name, mask=mask, sliding_window=window, positions=positions, kv_sizes=sizes,
                     cache_argument=cache_arg)


def _decoder_window(model) -> int | None:
    """The sliding window of an encoder-decoder's decoder layers of type "sliding_attention" (T5Gemma), or None."""
    config = getattr(model.get_decoder(), "config", None)
    if "sliding_attention" not in (getattr(config, "layer_types", None) or ()):
        return None
    return config.sliding_window


def check_class(model, role: str) -> None:
    """ValueError naming ``role`` where the model's class decodes by a loop of its own (``_own_generate_reason``):
    read from the class alone, so it can run first (Qwen2.5-Omni's get_input_embeddings raises NotImplementedError,
    which the prompt's vocabulary check reached before the refusal)."""
    reason = _own_generate_reason(model)
    if reason is not None:
        raise ValueError(f"{role}: {type(model).__name__} cannot be driven exactly by speculative_kernels: {reason}")


def _own_generate_reason(model) -> str | None:
    """Why a transformers class's own generate() or decoding-loop method (``LOOP_METHODS``: steps that
    speculative_kernels.generate would skip) rules the model out, or None. A user's own subclass may override
    generate: it is theirs to call or not."""
    for method in LOOP_METHODS:
        owner = next((klass for klass in type(model).__mro__ if method in vars(klass)), None)
        if owner is not None and owner.__name__ != "GenerationMixin" and owner.__module__.startswith("transformers.") \
                and (owner.__name__, method) not in LOOP_OVERRIDES_REVIEWED:
            return (f"{owner.__name__}.{method} replaces a step of HF's generation loop (e.g. what each step reads or "
                    "emits), which speculative_kernels does not reproduce")
    owner = next((klass for klass in type(model).__mro__ if "generate" in vars(klass)), None)
    if owner is None or owner.__name__ == "GenerationMixin" or not owner.__module__.startswith("transformers."):
        return None
    if owner.__name__ in GENERATE_ROUTES_INPUTS_ONLY and not getattr(model, "_hf_peft_config_loaded", False):
        return None
    return (f"{owner.__name__}.generate adds steps of its own to HF's generation loop (its own inputs, processors "
            "or adapters), which speculative_kernels does not reproduce")


def _own_bound_method(model, method: str) -> bool:
    """Whether the instance attribute ``method`` is the class's own method bound to ``model``: it changes nothing
    (a PEFT prompt-learning wrapper's generate leaves its base model's prepare_inputs_for_generation so, restored as
    the bound method it saved)."""
    value = vars(model)[method]
    return getattr(value, "__self__", None) is model and getattr(value, "__func__", None) is getattr(type(model),
                                                                                                   method, None)


def _custom_step_reason(model) -> str | None:
    """Why a target whose own code (a user's subclass, remote code loaded with trust_remote_code, a function set on
    the instance) replaces a step of model.generate is ruled out, or None: ``prepare_inputs_for_generation`` (an
    extra keyword for the forward, other ids or positions), ``_update_model_kwargs_for_generation`` or a
    ``LOOP_METHODS`` method (another processor, another loop). model.generate runs it at every step; the runners call
    the forward directly with their own ids, masks, positions and cache, so what it changes would be skipped without
    a word. transformers' own overrides are reviewed one by one (``_own_generate_reason``, ``_own_positions_reason``).
    A draft's may: its logits are read as given."""
    for method in (*STEP_METHODS, *LOOP_METHODS):
        if method in vars(model) and not _own_bound_method(model, method):
            return (f"its instance attribute {method} replaces GenerationMixin's, which model.generate calls at "
                    "every step and speculative_kernels does not (it calls the forward directly); delete the attribute "
                    "or use model.generate")
        owner = next((klass for klass in type(model).__mro__ if method in vars(klass)), None)
        if owner is not None and not owner.__module__.startswith("transformers."):
            return (f"{owner.__name__}.{method} (in {owner.__module__}, not transformers) replaces a step of "
                    "model.generate, which speculative_kernels does not run: it calls the forward directly with its "
                    "own ids, masks, positions and cache, so what the override adds or changes would be skipped. Move "
                    "what it does into forward (e.g. a keyword's default), remove the override where it does only "
                    "what GenerationMixin's does, or use model.generate")
    return None


def _own_positions_reason(model) -> str | None:
    """Why the model's own position rule rules it out, or None: a transformers ``prepare_inputs_for_generation`` (of
    the model or of a submodule it generates through) that removes ``position_ids``, so HF's generate never passes
    them and the forward derives positions itself (Kosmos-2.5: from the input ids, pad tokens skipped, plus the
    cache length). Our runners pass position ids, which such a forward reads as table indices of another rule."""
    seen = set()
    for module in model.modules():
        owner = next((k for k in type(module).__mro__ if "prepare_inputs_for_generation" in vars(k)), None)
        if owner is None or owner in seen or not owner.__module__.startswith("transformers.models."):
            continue
        seen.add(owner)
        source = _source(vars(owner)["prepare_inputs_for_generation"])
        if _APPENDS_TO_INPUT_IDS.search(source) and not _DROPS_POSITION_IDS.search(source):
            return (f"{owner.__name__}.prepare_inputs_for_generation appends a token of its own to every step's input "
                    "ids (the position the next token is read at), which a verification forward over several "
                    "drafts does not reproduce")
        if _DROPS_POSITION_IDS.search(source):
            return (f"{owner.__name__}.prepare_inputs_for_generation drops position_ids, so its forward derives "
                    "positions itself (from the input ids and the cache length), which the verification forward's "
                    "explicit position ids do not reproduce")
    return None


def _decoder_stack_source(model) -> tuple[object, str]:
    """(the decoder stack (``base_model``), the source of its forward, "" where there is none to read)."""
    base = getattr(model, "base_model", None) or model
    return base, _source(type(base).forward)


def _bidirectional_reason(model) -> str | None:
    """Why a decoder-only model whose self-attention is not causal over a multi-token forward is ruled out, or None.
    Some transformers versions build such a model's mask with ``create_bidirectional_mask`` alone (BERT-family
    decoders in 5.17: MegatronBert, RemBert, RoFormer, BigBird, fixed later): ``model.generate`` then encodes the
    prompt bidirectionally and steps one token at a time, while a verification forward over several tokens would let
    each see the later drafts. Found from the decoder stack's source (that builder, and nothing causal), confirmed by
    one 2-token forward: in a causal model the first position's logits cannot depend on the second token."""
    base, source = _decoder_stack_source(model)
    if not _BIDIRECTIONAL_MASK.search(source) or "causal" in source:
        return None
    device = next(model.parameters()).device
    # (in training mode dropout would make any two rows differ, and offloaded weights (meta) are loaded by hooks on
    # another device: the source decides there)
    if not model.training and device.type != "meta":
        ids = torch.tensor([[0, 1], [0, 2]], device=device)
        with torch.no_grad():
            logits = model(input_ids=ids, use_cache=False, return_dict=True).logits
        if torch.equal(logits[0, 0], logits[1, 0]):
            return None
    return (f"{type(base).__name__} builds a bidirectional self-attention mask in this transformers version (a "
            "forward over several tokens lets each see the later ones), so a verification forward over the drafts is "
            "not the single steps of model.generate")


def _prefix_lm_reason(model) -> str | None:
    """Why a prefix LM is ruled out, or None. A text config with ``use_bidirectional_attention`` True or "all"
    (PaliGemma's default; Gemma 3 and Step3 for embeddings) makes ``model.generate``'s prefill attend bidirectionally
    over the prompt: its self-attention modules are built with ``is_causal=False``, and the prefill's mask lets each
    prompt token see the later ones (PaliGemma: only where transformers skips its SDPA mask, an unpadded batch; Gemma
    3: always). The speculative forwards are causal over the prompt, so the first token's logits and the prompt's
    cache would differ (measured on a tiny PaliGemma: 7e-4 of the logits' scale, rounding being 1e-7). ("vision":
    bidirectional over image tokens only, which text prompts do not hold.)"""
    value = getattr(model.config.get_text_config(decoder=True), "use_bidirectional_attention", None)
    if value is True or value == "all":
        return (f"its text config sets use_bidirectional_attention={value!r} (a prefix LM), so model.generate's "
                "prefill lets each prompt token attend to the later ones, while the speculative forwards are causal "
                "over the prompt")
    return None


def _two_d_mask_reason(model) -> str | None:
    """Why a decoder stack that assumes a 2-D attention mask at one-token steps is ruled out, or None (it
    concatenates ones to the mask, which fails on the 4-D masks the speculative forwards pass)."""
    base, source = _decoder_stack_source(model)
    if _WIDENS_2D_MASK_AT_STEPS.search(source):
        return (f"{type(base).__name__} widens a 2-D attention mask at one-token steps in this transformers version, "
                "which the explicit masks of the speculative forwards (over cache slots with holes) are not")
    return None


def check_model(model, *, path: str = "dynamic", batch: int = 1, target: bool = True) -> ModelSpec:
    """The ``ModelSpec`` a runner drives ``model`` by on ``path`` with ``batch`` rows, or ValueError naming the
    architecture and the reason. target: False for a draft, whose logits may depend on the tokens beside it
    (verification reads them as given), so activation scales set per forward do not rule it out."""
    if path not in PATHS:
        raise ValueError(f"unknown cache path {path!r}; expected one of {PATHS}")
    reason = (_own_generate_reason(model) or _own_positions_reason(model) or _dynamic_quantization_reason(model)
              or _inference_mode_reason(model) or row_hooks_reason(model))
    if reason is None and target:
        reason = (_custom_step_reason(model) or _activation_scales_reason(model) or hooks_reason(model)
                  or _step_size_clamp_reason(model))
    if reason is not None:
        _refuse(type(model).__name__, path, reason)
    if getattr(model.config, "is_encoder_decoder", False):
        return dataclasses.replace(_check_encoder_decoder(model, path), forward_flags=forward_flags(model))
    reason = (_bidirectional_reason(model) or _prefix_lm_reason(model) or _two_d_mask_reason(model)
              or _input_id_positions_reason(model))
    if reason is not None:
        _refuse(type(model).__name__, path, reason)
    spec = _check_decoder_only(model, path, batch)
    reason = _own_forward_contract_reason(model, spec.cache_argument)
    if reason is not None:
        _refuse(type(model).__name__, path, reason)
    if _WIDENS_2D_MASK_OVER_CACHE.search(_decoder_stack_source(model)[1]):
        spec = dataclasses.replace(spec, masked_slots_exact=False)
    return dataclasses.replace(spec, forward_flags=forward_flags(model))


def forward_flags(model) -> tuple[tuple[str, object], ...]:
    """(keyword, value) pairs the runners pass to every forward of ``model``, overriding its config's defaults:
    ``output_router_logits=False`` where the forward takes it. A mixture-of-experts config with
    ``output_router_logits: true`` (a training run's load-balancing loss, kept in a fine-tune's config.json) makes
    the forward multiply its router weights by the 2-D attention mask for that loss, which fails on a forward of
    several tokens over a cache (the mask spans the cache's slots, as for model.generate's one-token steps, which
    broadcast); the router logits feed only that loss, never the logits, so the tokens are the same."""
    return (("output_router_logits", False),) if "output_router_logits" in _parameters(model) else ()


def _dynamic_quantization_reason(model) -> str | None:
    """torch's dynamic quantization (``torch.ao.quantization.quantize_dynamic``) quantizes each forward's
    activations with one scale over all its tokens, so a token's logits depend on the tokens beside it: a
    verification forward over several does not reproduce one-token steps (measured: other greedy tokens, the target
    its own draft)."""
    quantized = sorted({type(m).__name__ for m in model.modules() if ".quantized.dynamic" in type(m).__module__})
    if quantized:
        return (f"it holds dynamically quantized modules ({', '.join(quantized)}: "
                "torch.ao.quantization.quantize_dynamic), which quantize activations with a scale over every token "
                "of a forward, so a multi-token verification forward gives other logits than one-token steps; use a "
                "float model")
    return None


def _inference_mode_reason(model) -> str | None:
    """optimum-quanto's 2- and 4-bit weights (``WeightQBitsTensor``, ``quantize(model, weights=qint4)`` or
    ``QuantoConfig(weights="int4")``) fail in every forward under ``torch.inference_mode``, which the loop runs in
    (model.generate runs under no_grad): "Cannot set version_counter for inference tensor" from inside quanto
    (optimum-quanto issue #304)."""
    names = [name for name, parameter in model.named_parameters()
             if any(cls.__name__ == "WeightQBitsTensor" and cls.__module__.startswith("optimum.quanto")
                    for cls in type(parameter).__mro__)]
    if names:
        return (f"its weights are optimum-quanto 2/4-bit tensors ({_first_names(names)}: WeightQBitsTensor), whose "
                "forward fails under torch.inference_mode, which speculative_kernels runs in (optimum-quanto issue "
                "#304); quantize weights to qint8 or qfloat8")
    return None


def _activation_scales_reason(model) -> str | None:
    """A target whose activations are scaled per forward (over all its tokens): a verification forward over several
    tokens gives other logits than one-token steps. (A draft may: its logits are read as given.)"""
    fake = _fake_quantizers(model)
    observing = [name for name, observes in fake if observes]
    if observing:
        return (f"it holds fake-quantize modules whose observers are on ({_first_names(observing)}: "
                "quantization-aware training), which set their scales from each forward's activations, so a "
                "multi-token verification forward gives other logits than one-token steps; use it as the draft "
                "(with the float model as the target), or model.generate")
    if fake:
        names = _first_names([name for name, _ in fake])
        return (f"it holds fake-quantize modules ({names}: quantization-aware training, the scales as trained), "
                "which round activations to a grid: that turns the float rounding by which a multi-token "
                "verification forward differs from one-token steps (1e-7) into whole quantization steps (measured: "
                "1.4e-2 at a logit scale of 0.75, another top token at 1 of 60 prompts); use it as the draft (with "
                "the float model as the target), or model.generate")
    quanto = _quanto_quantized_activations(model)
    if quanto:
        return (f"its layers are optimum-quanto modules that quantize activations ({_first_names(quanto)}), which "
                "round them to a grid: that turns the float rounding by which a multi-token verification forward "
                "differs from one-token steps into whole quantization steps (measured with qfloat8 activations: "
                "2.2e-2 at a logit scale of 0.75); quantize weights only (quantize(model, weights=qint8)), or use it "
                "as the draft")
    quantized = _torchao_quantized_activations(model)
    if quantized:
        return (f"its weights are torchao tensors that quantize activations ({_first_names(quantized)}): "
                "a per-tensor scale spans several tokens, and even per row (one scale per token) rounding to the "
                "quantization grid turns the float rounding by which a multi-token verification forward differs "
                "from one-token steps (1e-7) into whole quantization steps (measured: 1e-2 at a logit scale of 0.75, "
                "other greedy tokens); quantize weights only (e.g. Int8WeightOnlyConfig), or use it as the draft")
    return None


def _first_names(names: list[str], shown: int = 3) -> str:
    more = f", and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def _fake_quantizers(model) -> list[tuple[str, bool]]:
    """(name, observing) of each torch.ao fake-quantize module (``prepare_qat``) fake-quantizing; observing: its
    observer is on too, updating the scale at every forward (in eval mode too)."""
    from torch.ao.quantization import FakeQuantizeBase

    return [(name or "model", bool(module.observer_enabled[0])) for name, module in model.named_modules()
            if isinstance(module, FakeQuantizeBase) and bool(module.fake_quant_enabled[0])]


def _quanto_quantized_activations(model) -> list[str]:
    """"name (qtype)" of each optimum-quanto module (``QModuleMixin``: ``quantize(model, activations=...)``,
    ``QuantoConfig(activations=...)``) that quantizes its inputs."""
    return [f"{name} ({module.activation_qtype})" for name, module in model.named_modules()
            if getattr(module, "activation_qtype", None) is not None
            and any(cls.__name__ == "QModuleMixin" and cls.__module__.startswith("optimum.quanto")
                    for cls in type(module).__mro__)]


def _torchao_quantized_activations(model) -> list[str]:
    """"name (scheme)" of each torchao weight (a tensor subclass, ``torchao.quantization.quantize_``) that quantizes
    its layer's activations: ``act_quant_kwargs`` (``Int8DynamicActivationInt8WeightConfig`` per row or per tensor,
    ``Float8DynamicActivationFloat8WeightConfig``; with a static ``act_quant_scale`` too, which rounds to a grid
    alike), ``activation_quantization`` (``Int8DynamicActivationIntxWeightConfig``: per token), its packed CPU layouts
    (``IntxOpaqueTensor``, packed from per-token ones only; ``Int4OpaqueTensor`` with ``act_mapping_type``: the
    prototype ``Int8DynamicActivationInt4WeightConfig``, DA8W4), or torchao's older ``input_quant_func`` wrapper. One linear layer alone is exact per row (identical
    rows give identical outputs at any width), but the model's inputs to it are not: attention rounds a forward of
    several query tokens differently from one (1e-7), and a value at a rounding boundary moves a whole step (measured
    on a tiny Llama, per row: 1e-2 of the logits' scale, other greedy tokens in 7 of 20 prompts; weight-only: 3e-7,
    as the float model)."""
    found = []
    for name, parameter in model.named_parameters():
        if not type(parameter).__module__.startswith("torchao"):
            continue
        kwargs = getattr(parameter, "act_quant_kwargs", None)
        per_token = getattr(parameter, "activation_quantization", None)
        if kwargs is not None:
            found.append(f"{name} ({getattr(kwargs, 'granularity', None)!r})")
        elif per_token is not None:
            found.append(f"{name} ({getattr(per_token, 'value', per_token)})")
        elif getattr(parameter, "input_quant_func", None) is not None:  # torchao's older activation wrapper
            found.append(f"{name} (activation quantization of {type(parameter).__name__})")
        elif getattr(parameter, "act_mapping_type", None) is not None:  # Int4OpaqueTensor's DA8W4 (x86 CPU)
            found.append(f"{name} (int8 {parameter.act_mapping_type} activations of {type(parameter).__name__})")
        elif type(parameter).__name__ == "IntxOpaqueTensor":  # packed from int8_asym_per_token weights only
            found.append(f"{name} (int8_asym_per_token of IntxOpaqueTensor)")
    return found


def position_dependent_rope(model) -> list[tuple[str, int]]:
    """[(rope_type, limit)] of ``model``'s rotary embeddings whose frequencies follow the longest position of each
    forward (transformers' ``dynamic_rope_update``): "dynamic" NTK scaling recomputes them once a forward's sequence
    length passes ``limit`` (the module's ``original_max_seq_len``), "longrope" switches to its long factors past
    ``original_max_position_embeddings``. Empty for the static kinds (default, linear, llama3, yarn, ...).

    Up to ``limit`` every forward uses the same frequencies, whatever its width. Past it they depend on the forward's
    longest position: a verification forward reaches positions a one-token step of ``model.generate`` has not yet,
    so its logits would differ (by far more than rounding: measured 5e-5 and 1e-3 on tiny models)."""
    found = []
    for module in model.modules():
        kinds = getattr(module, "rope_type", None)
        per_layer = kinds if isinstance(kinds, dict) else {None: kinds}
        for layer_type, kind in per_layer.items():
            if not isinstance(kind, str) or not ("dynamic" in kind or kind == "longrope"):
                continue
            config = getattr(module, "config", None) or model.config.get_text_config(decoder=True)
            if "dynamic" in kind:
                limit = getattr(module, "original_max_seq_len", None)
            else:
                params = getattr(config, "rope_parameters", None) or {}
                params = params.get(layer_type, {}) if layer_type is not None else params
                limit = params.get("original_max_position_embeddings",
                                   getattr(config, "original_max_position_embeddings", None))
            if limit is None:
                limit = getattr(config, "max_position_embeddings", None)
            found.append((kind, int(limit) if limit is not None else 0))
    return found


def _position_remedy(limit: int, longest: int, overshoot: int) -> str:
    """What to lower so that a request reaching ``longest`` plus ``overshoot`` drafted positions fits ``limit``."""
    room = limit + 1 - overshoot  # the most prompt + max_new_tokens can be with this overshoot
    remedies = [f"lower max_new_tokens (or max_length) so that prompt + max_new_tokens <= {room}"] if room >= 2 else []
    if overshoot and longest < limit:
        remedies.append(f"lower num_speculative_tokens to at most {limit - longest}")
    if not remedies:
        remedies.append(f"lower max_new_tokens (or max_length) so that prompt + max_new_tokens <= {limit + 1}, and "
                        "num_speculative_tokens")
    return ", or ".join(remedies)


def _overshoot_note(overshoot: int) -> str:
    return (f" plus up to {overshoot} drafted positions, since in a batch a row near its end is verified beside rows "
            "with more tokens left, with drafts past its last position (never accepted, but the forward reaches them)"
            if overshoot else "")


def check_expert_capacity(model, prompt_tokens: int, max_gamma: int, name: str = "model") -> None:
    """ValueError where ``model``'s experts take at most ``config.expert_capacity`` tokens of one sequence's forward
    and drop the rest (Switch Transformers' router: a cumulative count over the forward's tokens), and some forward
    of model.generate or of ours could pass that count: model.generate's first forward runs the ``prompt_tokens``
    (the decoder prompt of an encoder-decoder model) and then one token a step, ours the prompt in at most as many
    and verifications of up to ``max_gamma`` + 1. Within the capacity no token is dropped in either, so both route
    alike; past it a verification would drop tokens that one-token steps keep (other tokens, measured)."""
    if getattr(model.config, "expert_capacity", None) is None:
        return
    # (the routers hold their own copy of the config's value; the smallest binds)
    capacities = [getattr(m, "expert_capacity", None) for m in (model.config, *model.modules())]
    capacities = [c for c in capacities if isinstance(c, int) and not isinstance(c, bool)]
    if not capacities:
        return
    capacity = min(capacities)
    widest = max(prompt_tokens, max_gamma + 1)
    if capacity < widest:
        raise ValueError(
            f"{name} ({type(model).__name__}) routes at most expert_capacity={capacity} tokens of one forward to an "
            f"expert and drops the rest, and this request's forwards reach {widest} tokens (a verification of "
            f"num_speculative_tokens + 1 = {max_gamma + 1}, a prompt of {prompt_tokens}): a verification forward "
            "could drop tokens that model.generate's one-token steps keep. Pass num_speculative_tokens < "
            f"{capacity} (and a prompt of at most {capacity} tokens), or raise config.expert_capacity")


def check_positions(model, longest: int, shortest: int | None = None, overshoot: int = 0) -> None:
    """ValueError when a request's longest row reaches ``longest`` sequence length (its prompt's real tokens plus its
    new tokens, less one: the longest forward ``model.generate`` runs) past the limit of a position-dependent rotary
    embedding (``position_dependent_rope``), where speculative decoding could not reproduce ``model.generate``.

    shortest: the sequence length of the request's first forward (its longest prompt less the token held back for
    the first verification), or None (a row of a continuous batch, whose batch-mates set the forward's longest
    position). "longrope" uses one set of factors per forward, so a request whose first forward is already past the
    limit uses the long factors in every forward, ours and model.generate's alike: exact. "dynamic" recomputes its
    frequencies at every new length past the limit, so no request may pass it.

    overshoot: how far past a row's last position a batch's verification forward can reach (its gamma; 0 at batch
    1, where gamma is capped by the row's own tokens left): the frequencies follow the longest position of the whole
    forward, so one row reaching past the limit would change every row's."""
    for kind, limit in position_dependent_rope(model):
        if kind == "longrope" and shortest is not None and shortest > limit:
            continue
        if longest + overshoot > limit:
            raise ValueError(
                f"{type(model).__name__} uses rope_type={kind!r}, whose rotary frequencies change once a forward's "
                f"sequence passes {limit} positions and then depend on the forward's longest position; a speculative "
                "verification forward reaches positions a one-token step has not, so past that point the output "
                f"would differ from model.generate. This request reaches {longest + overshoot} (prompt + "
                f"max_new_tokens - 1{_overshoot_note(overshoot)}): {_position_remedy(limit, longest, overshoot)}"
                + (f" (or, for one call of generate, give a prompt longer than {limit + 1} tokens: every forward then "
                   "uses the long factors)" if kind == "longrope" else ""))


# Names of learned absolute-position tables (GPT-2's wpe, OPT's and BART's embed_positions, BERT-like decoders'
# position_embeddings): an ``nn.Embedding`` that a position past its config's limit indexes out of range.
_POSITION_TABLES = ("wpe", "embed_positions", "position_embeddings")
# Fixed tables held as buffers [positions, dim] and indexed by position (CTRL's ``pos_encoding``, GPT-J's and
# CodeGen's rotary sin/cos ``embed_positions``): the same limit.
_POSITION_BUFFERS = ("pos_encoding", "embed_positions")


def position_table_limit(model, part: str = "decoder") -> int | None:
    """The most positions the text decoder's (``part="encoder"``: an encoder-decoder's encoder's) learned
    absolute-position table holds (its config's ``n_positions`` or ``max_position_embeddings``), or None for models
    without one (rotary, ALiBi, relative, sinusoidal). A generic wrapper's decoder: ``wrapped_position_limit``."""
    if part == "decoder" and is_wrapper(model):
        return wrapped_position_limit(model)
    # (a wrapper's get_text_config(decoder=False) is the wrapper's own config)
    config = model.config.encoder if is_wrapper(model) else model.config.get_text_config(decoder=part == "decoder")
    limit = next((v for v in (getattr(config, a, None) for a in ("n_positions", "max_position_embeddings"))
                  if isinstance(v, int) and not isinstance(v, bool)), None)
    if limit is None:
        return None
    # (the text decoder's own table only: an audio or vision tower's, e.g. Whisper's embed_positions, is another's)
    getter = getattr(model, "get_decoder" if part == "decoder" else "get_encoder", None)
    stack = getter() if callable(getter) else None
    if part == "encoder" and not isinstance(stack, torch.nn.Module):
        return None
    root = stack if isinstance(stack, torch.nn.Module) else model
    for name, module in root.named_modules():
        if (isinstance(module, torch.nn.Embedding) and name.rsplit(".", 1)[-1] in _POSITION_TABLES
                and limit <= module.num_embeddings <= limit + 2  # (OPT's and BART's tables start at offset 2)
                and not callable(getattr(module, "make_weight", None))):  # (FSMT's sinusoids grow as needed)
            return limit
    for name, buffer in root.named_buffers():  # CTRL's sinusoid table, a buffer indexed by position
        if name.rsplit(".", 1)[-1] in _POSITION_BUFFERS and buffer.dim() == 2 and buffer.shape[0] == limit:
            return limit
    return None


def slot_table_limit(model) -> int | None:
    """The most key slots a forward of ``model`` can take, where its attention slices a table sized by its position
    limit with the cache's key length (not with positions): GPT-Neo's causal ``bias`` buffer [1, 1, N, N] (its global
    layers) and MPT's ALiBi, built for ``max_seq_len`` keys. None for every other model. Past it, transformers fails
    with a size mismatch: HF's caches never hold more slots than positions, ours may (the static cache's slack)."""
    config = model.config.get_text_config()
    if getattr(config, "model_type", None) == "mpt":
        return int(config.max_seq_len)
    limits = [buffer.shape[-1] for name, buffer in model.named_buffers()
              if name.endswith("attention.bias") and buffer.dim() == 4 and buffer.shape[-1] == buffer.shape[-2]
              and getattr(config, "model_type", None) == "gpt_neo"]
    return min(limits) if limits else None


def check_position_table(model, longest: int, name: str = "model", encoder_width: int | None = None,
                         overshoot: int = 0) -> None:
    """ValueError when a request's longest row (its prompt's real tokens plus new tokens, less one; an
    encoder-decoder's decoder prompt) needs more positions than the model's learned position table holds:
    ``model.generate`` fails there with an IndexError inside the embedding (HF's assisted generation too, for a
    draft), and so would the speculative forwards. encoder_width: an encoder-decoder's encoder input width, checked
    against its encoder's table (BART's learned positions), or None. overshoot: as for ``check_positions`` (a
    batch's rows near their end are fed drafts past their last position, which must still index the table)."""
    encoder_limit = position_table_limit(model, "encoder") if encoder_width is not None else None
    if encoder_limit is not None and encoder_width > encoder_limit:
        raise ValueError(f"{name} ({type(model).__name__}) has an encoder position table of {encoder_limit} "
                         f"positions, and the encoder input is {encoder_width} tokens long: shorten input_ids")
    limit = position_table_limit(model)
    if limit is not None and longest + overshoot > limit:
        raise ValueError(
            f"{name} ({type(model).__name__}) has a learned position table of {limit} positions, and this request "
            f"reaches {longest + overshoot} (prompt + max_new_tokens - 1{_overshoot_note(overshoot)}): "
            f"{_position_remedy(limit, longest, overshoot)}"
            + (", or use a draft with a longer context" if name in ("draft_model", "draft") else ""))


def check_window_holes(spec: ModelSpec, attention_mask, longest: int | list[int],
                       name: str = "attention_mask") -> None:
    """ValueError naming the rows where ``attention_mask`` [B, L] masks a token after the row's first real one, for a
    model with sliding-window layers (``spec.sliding_window``) and forwards over up to ``longest`` slots (prompt width
    plus new tokens but the last, which is never fed) that a window may not span; a list: each row's own (a batch of
    separate requests, each spanning its own prompt and new tokens from its first real token). HF's window counts
    cache slots, masked ones included (``q_slot - k_slot < window``); the runners' windows count real positions, which
    their own holes (rejected drafts) must not shift, so the two differ once a masked slot lies inside a window. Left
    padding never does. One host read, before decoding starts."""
    spans = longest if isinstance(longest, list) else [longest] * (0 if attention_mask is None else len(attention_mask))
    if spec.sliding_window is None or attention_mask is None or max(spans, default=0) - 1 < spec.sliding_window:
        return
    real = attention_mask.bool()
    spanning = torch.tensor(spans, device=real.device) - 1 >= spec.sliding_window
    holes = ((real.to(torch.int64).cumsum(dim=1) > 0) & ~real).any(dim=1) & spanning
    if bool(holes.any()):
        raise ValueError(f"{name} masks tokens after the first real one in rows {holes.nonzero().flatten().tolist()} "
                         f"(not left padding; a pad_token_id inside a prompt is masked so too), which "
                         f"{spec.architecture}'s sliding-window layers (window {spec.sliding_window}) would count as "
                         "HF does, in slots, and the speculative caches do not; pass the prompts without them")


def check_masked_slots(spec: ModelSpec, attention_mask, name: str = "attention_mask") -> None:
    """ValueError where ``attention_mask`` [B, L] masks a slot (left padding, a pad_token_id inside a prompt) for a
    model whose ``model.generate`` steps do not mask it (``spec.masked_slots_exact`` False: GIT widens the step's
    2-D mask by image tokens the cache does not hold, so a padded row's later steps attend to its padding). One host
    read, before decoding starts. A model with recurrent states (``spec.recurrent``) takes no masked token at all:
    HF zeroes a masked token's input to the state, which the runner's unmasked forwards would not."""
    if (spec.masked_slots_exact and not spec.recurrent) or attention_mask is None or bool(attention_mask.bool().all()):
        return
    if spec.recurrent:
        raise ValueError(f"{name} masks tokens (padding) of the prompt of a {spec.architecture}, which keeps a "
                         "recurrent state: speculative_kernels drives it at batch 1 on prompts without masked tokens; "
                         "pass the prompt without them")
    raise ValueError(f"{name} masks slots (padding) of a {spec.architecture}, whose model.generate widens the "
                     "attention mask of every step after the prompt by image tokens a text-only cache does not hold, "
                     "so its steps attend to those slots: speculative decoding cannot reproduce that; pass prompts "
                     "without padding (one at a time, or through add_request)")


def check_window_applied(spec: ModelSpec, longest: int) -> None:
    """ValueError for a request of up to ``longest`` slots (prompt width plus new tokens but the last) on a model
    whose HF cache keeps a sliding window that its attention does not apply (``spec.window_applied`` False). There
    ``model.generate`` attends to the whole prompt at prefill and, once the cache has dropped slots, to the last
    ``window`` slots only: a verification forward, whose mask applies the window to every token or to none, cannot
    follow it. Requests the window spans (``longest <= window``) never reach the difference and run. A window of one
    position is refused as well: HF's sliding cache keeps every slot there (its prefill applies the window, its
    one-token steps attend to the whole cache), which no forward applying the window follows."""
    window = spec.sliding_window
    if window is None or longest <= window:
        return
    if window == 1:
        raise ValueError(
            f"{spec.architecture}'s config sets sliding_window=1, where HF's sliding cache keeps every slot: "
            "model.generate applies the one-position window at prefill but attends to the whole cache at each later "
            "step, which speculative decoding cannot reproduce (it applies the window in every forward, as HF's "
            "use_cache=False does). Set the target's config.sliding_window to a window of 2 or more, or to None")
    if spec.window_applied:
        return
    raise ValueError(
        f"{spec.architecture}'s config sets sliding_window={window}, which HF's cache keeps (it drops all but the "
        f"last {window} slots) but its attention does not apply: model.generate attends to the whole prompt at "
        f"prefill and to the last {window} slots after it, which speculative decoding cannot reproduce. This request "
        f"reaches {longest} slots (prompt + max_new_tokens - 1): keep prompt + max_new_tokens <= {window + 1}, or "
        "set model.config.sliding_window = None (and the draft's) where the checkpoint has no window")


# Attributes through which HF modules apply dropout functionally (``dropout=0.0 if not self.training else
# self.attention_dropout``, ``F.dropout(x, p=self.activation_dropout, training=self.training)``) rather than through an
# nn.Dropout module: these by name (a property counts too), and any float attribute named for dropout
# (activation_dropout: BART, BioGPT, Whisper, ...; residual_dropout and embedding_dropout: Starcoder2; hidden_dropout:
# MPT; resid_pdrop: DBRX).
_DROPOUT_ATTRIBUTES = ("attention_dropout", "attn_dropout", "dropout")
_DROPOUT_NAME = re.compile(r"dropout|pdrop$")
# Other randomness transformers applies in training mode only: LayerDrop (``if self.training and self.layerdrop >
# 0.0``, also read from the module's config), router/input jitter noise (Mixtral, Qwen-MoE, DBRX, ...), drop-path.
_TRAINING_NOISE_ATTRIBUTES = ("layerdrop", "jitter_noise", "router_jitter_noise", "input_jitter_noise",
                              "moe_jitter_eps", "drop_prob", "drop_rate")


def _training_randomness(module, via_config: bool) -> str | None:
    """What makes ``module``'s forward random in training mode ("dropout p=0.1", "layerdrop=0.2"), or None; with
    ``via_config``, the noise settings its config holds (which some modules read there) instead."""
    if via_config:
        source = getattr(module, "config", None)
    else:
        if isinstance(getattr(module, "p", None), float) and "Dropout" in type(module).__name__:
            p = module.p
        else:
            names = {*_DROPOUT_ATTRIBUTES, *(k for k in vars(module) if _DROPOUT_NAME.search(k))}
            p = max((v for k in names if isinstance(v := getattr(module, k, None), float)), default=0.0)
        if p > 0:
            return f"dropout p={p}"
        alpha = neftune_alpha(module)
        if isinstance(alpha, (int, float)) and alpha > 0:
            return f"NEFTune noise, neftune_noise_alpha={alpha}"
        source = module
    for attribute in _TRAINING_NOISE_ATTRIBUTES:
        value = getattr(source, attribute, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            return f"{attribute}={value}"
    return None


def check_deterministic(model) -> None:
    """ValueError naming the first randomness active in ``model``: in training mode (``model.train()``, or a model
    built from a config without ``.eval()``) dropout (and LayerDrop, MoE jitter noise, drop-path) makes every
    forward random, ``model.generate``'s too, so no output can be identical to it and the target's distribution is
    not one distribution. Only the target needs this: a draft's q is whatever its forward gave, which verification
    reads as given. Any module in training mode counts (a model in eval mode with a submodule left in training)."""
    found = _active_randomness(model)
    if found is not None:
        at_inference = "sample_at_inference" in found
        raise ValueError(f"{type(model).__name__} {'runs' if at_inference else 'is in training mode'} with {found}, "
                         "so every forward is random (model.generate's too) and no output can be exact; "
                         + ("build the adapter with sample_at_inference=False (its mean)" if at_inference else
                            "call model.eval() before generating"))
    stateful = _training_state_updates(model)
    if stateful:
        raise ValueError(f"{type(model).__name__} is in training mode with spectral_norm ({_first_names(stateful)}), "
                         "whose power iteration updates the weight at every forward: one per token in "
                         "model.generate, one per iteration here, so the weights and the output would differ; call "
                         "model.eval() before generating")


def _training_state_updates(model) -> list[str]:
    """Names of modules in training mode whose forward updates a weight (spectral_norm's power iteration, as a
    parametrization or as the older forward pre-hook)."""
    from torch.nn.utils.spectral_norm import SpectralNorm

    found = []
    for name, module in model.named_modules():
        if not module.training:
            continue
        if type(module).__name__ == "_SpectralNorm" or any(isinstance(hook, SpectralNorm)
                                                          for hook in module._forward_pre_hooks.values()):
            found.append(name or "model")
    return found


def _active_randomness(model) -> str | None:
    """The first randomness active in ``model``'s modules in training mode ("dropout active (layers.0: p=0.1)"), or
    None; and a PEFT layer's own (``adapters.adapter_randomness``: some in eval mode too)."""
    adapter = next(((name, why) for name, module in model.named_modules()
                    if (why := adapter_randomness(module)) is not None), None)
    if adapter is not None:
        return f"a PEFT layer's randomness active ({adapter[0]}: {adapter[1]})"
    idle = idle_adapter_modules(model)  # (a merged or disabled adapter's lora_dropout is never called)
    found = next(((name, randomness) for via_config in (False, True) for name, module in model.named_modules()
                  if module.training and id(module) not in idle
                  and (randomness := _training_randomness(module, via_config)) is not None), None)
    if found is None:
        return None
    name, randomness = found
    kind = "dropout active" if randomness.startswith("dropout") else "training-mode randomness active"
    return f"{kind} ({name or 'model'}: {randomness.removeprefix('dropout ')})"


def check_seeded_draft(draft, seed: int | None, name: str = "draft_model") -> None:
    """ValueError where ``seed`` is given but the draft's forwards are random (training mode with dropout): they
    draw from torch's global generator, which ``seed`` does not key, so two calls with one seed would differ (the
    output distribution stays exact: q is whatever the forward gave) and the global generator would advance."""
    if seed is None or draft is None:
        return
    found = _active_randomness(draft)
    if found is not None:
        at_inference = "sample_at_inference" in found
        fix = "build its adapter with sample_at_inference=False" if at_inference else f"call {name}.eval()"
        raise ValueError(f"seed={seed} cannot make this run reproducible: {name} ({type(draft).__name__}) "
                         f"{'runs' if at_inference else 'is in training mode'} with {found}, whose forwards draw "
                         f"random numbers that seed does not key; {fix}, or pass no seed")


def check_caching(model, name: str = "model") -> None:
    """ValueError where gradient checkpointing is active (``gradient_checkpointing_enable()`` and training mode):
    transformers' checkpointed layers then drop ``past_key_values`` (``GradientCheckpointingLayer``), so a forward
    neither reads nor fills a KV cache. ``model.generate`` still runs (recomputing the sequence every step);
    speculative decoding needs the cache it rolls back."""
    if model is None:
        return
    for module_name, module in model.named_modules():
        if (module.training and getattr(module, "gradient_checkpointing", False) is True
                and not getattr(module, "_can_checkpoint_with_cache", False)):
            raise ValueError(f"{name} ({type(model).__name__}) has gradient checkpointing active in training mode "
                             f"({module_name or name}), which makes transformers drop its KV cache in every forward; "
                             f"call {name}.eval() (or {name}.gradient_checkpointing_disable()) before generating")


def check_request(target, draft, *, path: str, batch: int) -> tuple[ModelSpec, ModelSpec]:
    """Check both models of a request before anything is allocated: (target spec, draft spec), or ValueError naming
    the first refusal."""
    return check_model(target, path=path, batch=batch), check_model(draft, path=path, batch=batch, target=False)


def request_path(static: bool, compiled: bool) -> str:
    return "compile" if compiled else "static" if static else "dynamic"
