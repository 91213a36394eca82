"""``speculative_kernels.generate``: a drop-in for ``model.generate`` that speculates with a draft model, prompt
lookup or a drafter of one's own."""

import dataclasses

import torch

from .adapters import unwrap_adapters
from .options import BatchingOptions, CompileOptions
from .outputs import SpeculativeDecoderOnlyOutput, SpeculativeEncoderDecoderOutput, cache_field
from .request import build_loop
from .stats import SpeculationStats


def generate(
    model,
    input_ids: torch.Tensor | None = None,
    *,
    draft_model=None,
    num_speculative_tokens: int | str | None = None,
    assistant_model=None,
    tokenizer=None,
    assistant_tokenizer=None,
    generation_config=None,
    speculation_stats: SpeculationStats | None = None,
    backend: str = "auto",
    compile=False,
    batching: BatchingOptions | None = None,
    drafter=None,
    seed: int | None = None,
    **kwargs,
):
    """Speculative decoding with ``model.generate``'s arguments and return values.

    input_ids: [B, L] (left-padded with ``attention_mask`` for B > 1). Returns a LongTensor [B, L + new] of prompt
    plus new tokens (on input_ids' device, as model.generate: ids may stay on the CPU with the model on CUDA), or a ``SpeculativeDecoderOnlyOutput`` (a ``GenerateDecoderOnlyOutput``) with
    ``return_dict_in_generate=True``, whose ``speculation_stats`` holds the statistics. With a tensor result, pass
    ``speculation_stats=SpeculationStats()`` to have it filled in. Two differences from HF's output object: its
    cache field (``cache``; ``past_key_values`` before transformers 5.24) is None (our caches hold rolled-back
    slots; a prompt cache extended by the call is returned there, as HF returns it), and in a batch, ``scores``/``logits`` of a row at steps after it finished (where its sequence holds
    pad_token_id) are zeros, where HF keeps running the finished row on its pad tokens and returns those logits.
    ``past_key_values`` (``cache`` from transformers 5.24): a ``DynamicCache`` of the prompt's first P tokens, as
    ``model.generate`` takes it (HF's prompt-cache recipe): the target forwards the other tokens only, as HF does
    (the draft prefills the whole prompt). When the call returns, a batch-1 caller's cache is extended in place as
    model.generate extends it (the K/V of the prompt and of every new token but the last; HF's multi-turn recipe
    passes one cache to every turn) and is the output's cache field; at batch > 1 it is left as it was, with a
    UserWarning (HF's also holds the K/V of the pads it feeds finished rows), and a call that raises leaves it as it
    was. What it does not support is refused by name (``prompt_cache.py``).
    ``assistant_model`` is another name for ``draft_model``; ``tokenizer``/``assistant_tokenizer`` let a padded
    draft vocabulary be checked and used, and where their vocabularies differ the draft works on its own tokenization
    of the text (HF's universal assisted generation: ``retokenizing_drafter.py``, ``docs/different_tokenizers.md``).

    Encoder-decoder pairs (the types of ``capabilities.POSITION_KINDS``: T5-like, BART-like, Marian, M2M100, ...;
    HF's generic wrappers by the decoder they wrap, ``wrapped_seq2seq.py``; ``seq2seq_inputs.py``,
    ``runners/seq2seq.py``): input_ids and attention_mask are the encoder input (right-padded as usual; a vision or
    speech wrapper's ``pixel_values`` / ``input_values`` / ``input_features``, positionally or by name); the decoder starts from ``decoder_start_token_id``
    or from ``decoder_input_ids`` (with ``decoder_attention_mask``), and ``encoder_outputs`` may replace the target's
    encoder pass, as in HF (a draft with an encoder of its own still needs ``input_ids``). The result holds the decoder sequences; with ``return_dict_in_generate=True`` it is a
    ``SpeculativeEncoderDecoderOutput``.

    ``num_speculative_tokens`` (gamma) is the number of draft tokens per iteration, or ``"auto"``: start at 4,
    measure the acceptance rate alpha and the cost ratio c over the first iterations and continue with the gamma in
    1..16 that maximises the paper's expected speedup, or 0 (plain decoding, probing now and then) where none is
    expected to pay (``gamma.py``; the choice is in ``speculation_stats.num_speculative_tokens``). Not given: HF's
    ``num_assistant_tokens`` where it is set (the call, ``generation_config``, the target's or the draft's
    generation_config), else 5. An iteration never drafts more tokens than are left to generate (none when one is
    left).

    ``cache_implementation="static"`` preallocates both KV caches (``runners/static_decoder.py``; for encoder-decoder
    pairs the decoders' self-attention caches, ``runners/static_seq2seq.py``). ``compile=True`` (or a
    ``CompileOptions``) also captures the draft and verification steps with ``torch.compile`` (CUDA graphs on CUDA);
    its warm-up is reported in ``speculation_stats.warmup_time_s``, apart from ``total_time_s``. ``batching`` (a
    ``BatchingOptions``) tunes hole compaction and the dropping of finished rows (``docs/batching.md``).

    Without a draft model: ``prompt_lookup_num_tokens=k`` (with ``max_matching_ngram_size``, HF's names and default
    2) drafts up to k tokens per row copied from the row's own context (prompt, for encoder-decoder models the
    encoder input too, and what it generated; ``lookup_drafter.py``), or ``drafter=`` takes any object implementing
    the ``Drafter`` protocol (``drafter.py``), e.g. ``NGramDrafter`` (``ngram_drafter.py``); a drafter object serves
    one call.

    ``seed`` (ours; ``model.generate`` has no such argument): an int in [0, 2**63) that keys every random number of
    the call (draft sampling and verification), so the same seed gives the same output, without touching torch's
    global generator. Row b draws with the key ``ops.randomness.row_keys(torch.full((B,), seed))[b]`` whatever the
    batch size B: a row's numbers do not depend on the other rows, and a batch-1 call is row 0 of a call with the
    same seed. None (the default): a seed is drawn from torch's default generator, so ``torch.manual_seed`` makes
    runs repeatable.
    """
    if assistant_model is not None:
        if draft_model is not None and draft_model is not assistant_model:
            raise ValueError("pass either draft_model or assistant_model, not both")
        draft_model = assistant_model
    # A PEFT wrapper (LoRA, ...) runs the transformers model inside it: drive that one (adapters.py)
    model, draft_model = unwrap_adapters(model, "model"), unwrap_adapters(draft_model, "draft_model")
    if speculation_stats is not None and not isinstance(speculation_stats, SpeculationStats):
        raise TypeError(f"speculation_stats must be a SpeculationStats, got {type(speculation_stats).__name__}")
    compile_options = CompileOptions.from_argument(compile)
    encoder_decoder = bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False))  # (not a model:
    result_device = _result_device(input_ids, kwargs.get("decoder_input_ids"), encoder_decoder)  # build_loop says so)
    with torch.inference_mode():
        loop = build_loop(
            model, draft_model, input_ids, num_speculative_tokens=num_speculative_tokens, tokenizer=tokenizer,
            assistant_tokenizer=assistant_tokenizer, generation_config=generation_config, backend=backend,
            batching=batching, compile_options=compile_options, drafter=drafter, seed=seed, **kwargs
        )
        sequences, stats = loop.run()
    with torch.no_grad():  # (outside inference mode, as model.generate: the caller's cache holds ordinary tensors)
        caller_cache = loop.extend_caller_cache(stacklevel=2)
    # The loop runs in inference mode (cheaper per op than no_grad); what it returns is copied out of it, so that it is
    # an ordinary tensor as model.generate's (run under no_grad): editable in place, usable in autograd (RL rollouts).
    # It is on the device of the caller's ids, as model.generate's (which keeps ids on another device than the model,
    # e.g. the CPU, and moves only each forward's inputs): a copy either way; so are scores and logits, as HF's.
    sequences = sequences.clone() if result_device in (None, sequences.device) else sequences.to(result_device)
    if speculation_stats is not None:
        for field in dataclasses.fields(SpeculationStats):
            setattr(speculation_stats, field.name, getattr(stats, field.name))
    if not loop.plan.return_dict_in_generate:
        return sequences
    scores, logits = loop.collected_scores(sequences.shape[1] - loop.prompt_length, result_device)
    output = SpeculativeEncoderDecoderOutput if model.config.is_encoder_decoder else SpeculativeDecoderOnlyOutput
    return output(sequences=sequences, scores=scores, logits=logits, speculation_stats=stats,
                  **{cache_field(output): caller_cache})


def _result_device(input_ids, decoder_input_ids, encoder_decoder: bool) -> torch.device | None:
    """The device model.generate returns its sequences on: the caller's decoder_input_ids' (encoder-decoder, when
    given), else input_ids' (HF builds the decoder start on the encoder input's device); None: the model's."""
    for ids in (decoder_input_ids, input_ids) if encoder_decoder else (input_ids,):
        if isinstance(ids, torch.Tensor) and ids.numel() > 0:
            return ids.device
    return None
