"""Architecture coverage: every causal-LM, seq2seq and image-text-to-text class of the installed transformers (the
last generating from text alone), tiny random weights.

For each architecture and each path (dynamic cache, static cache, compile=True; batch 1, and batch 2 with a
left-padded row on the dynamic and static caches; continuous batching, two requests joining a running batch at
different steps) the result is:

* "exact": greedy ``speculative_kernels.generate`` equals ``model.generate`` token for token (and, in float32,
  the emitted tokens' logits agree to within 1e-4 of the largest logit up to each row's EOS), with a real, imperfect
  draft (the target with Gaussian noise on every weight) that causes rejections (checked: the acceptance rate is
  below 1);
* "refused: ...": ``capabilities.check_request`` (the check ``generate`` runs before allocating anything) raises a
  ``ValueError`` naming the architecture, and ``generate`` raises the same;
* "not checked: ...": the tiny config or HF's own ``model.generate`` could not be built/run generically;
* "DIFFERENT" / "ERROR: ...": a defect (a silent difference, or an error from inside transformers/torch).

Sliding windows are set to 6 (prompts are 10 tokens), so they bind. ``compile`` uses the ``aot_eager`` backend
(traces with dynamo and AOT autograd, no code generation; a CPU sweep). Usage:

    python benchmarks/coverage.py --out benchmarks/results/coverage.jsonl   # the sweep (about 10 minutes on 2 cores)
    python benchmarks/coverage.py --render benchmarks/results/coverage.jsonl --doc docs/architectures.md
    python benchmarks/coverage.py --only mistral,bloom                      # a few architectures
    python benchmarks/coverage.py --dtype bfloat16 --attn eager --out ...   # half precision, width-invariant
"""

import argparse
import json
import os
import re
import signal
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

COLUMNS = ("dynamic", "static", "compile", "batch2_dynamic", "batch2_static", "continuous", "continuous_static")
HEADERS = ("dynamic", "static", "compile", "batch > 1 (dynamic)", "batch > 1 (static)", "continuous",
           "continuous (static)")
PROMPT, NEW, GAMMA, NOISE = 10, 10, 3, (0.3, 1.0, 3.0)
LOGIT_TOLERANCE = 1e-4  # relative to the largest logit; float32 rounding was <= 3e-7 of it on 11 families


def _wrapped_timeout(error: BaseException | None):
    """The sweep's own per-architecture ``Timeout`` in error's chain of causes, or None (dynamo raises it again
    wrapped, as InternalTorchDynamoError or BackendCompilerFailed)."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, Timeout):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def _reraise_timeout(error: BaseException) -> None:
    """Re-raise a wrapped ``Timeout``: an architecture out of time is "not checked", not an ERROR."""
    timeout = _wrapped_timeout(error)
    if timeout is not None:
        raise timeout


class Timeout(Exception):
    pass


def _short(error: BaseException) -> str:
    text = str(error).splitlines()[0] if str(error) else ""
    return f"{type(error).__name__}: {text[:220]}"


def _models(model_type: str, kind: str, dtype: str = "float32", attn: str | None = None):
    """(target, [drafts]): the tiny target (weights in ``dtype``; ``attn``: an attention implementation, None:
    transformers' default) and copies of it with growing noise on every weight."""
    import copy

    import torch

    from speculative_kernels.generation.settings import REFUSED_UNLESS
    from tiny_configs import CAUSAL_SUB_CONFIG, tiny_config

    config = tiny_config(model_type, sliding_window=6)
    build = _auto_class(kind).from_config
    if kind == "causal" and model_type in CAUSAL_SUB_CONFIG:  # the auto class takes only the composite config
        import transformers
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        config = getattr(config, CAUSAL_SUB_CONFIG[model_type])
        build = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])._from_config
    torch.manual_seed(0)
    with _timm_towers_stubbed():
        target = build(config, **({"attn_implementation": attn} if attn else {})).eval()
    target.to(getattr(torch, dtype))
    for name, off in REFUSED_UNLESS.items():  # e.g. BlenderBot's no_repeat_ngram_size: the architecture is tested
        value = getattr(target.generation_config, name, None)
        if value is not None and value not in off:
            setattr(target.generation_config, name, off[0] if off else None)
    drafts = []
    for noise in NOISE:
        draft = copy.deepcopy(target)
        torch.manual_seed(1)
        with torch.no_grad():
            for p in draft.parameters():
                if p.is_floating_point() and p.numel() > 1:
                    p.add_(torch.randn_like(p) * noise * p.std().clamp(min=1e-3))
        drafts.append(draft)
    return target, drafts


TIMM_STUB_NOTE = "vision tower stubbed: timm is not installed, and generating from text never runs it"


def _stubbed_timm_tower():
    """Stands in for the timm model inside transformers' ``TimmWrapperModel`` (Gemma 3n's vision tower) where timm
    is not installed: one parameter, and a forward that raises, so a path that did run the tower would show as an
    error in the table rather than pass."""
    import torch

    class StubbedTimmTower(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.stub = torch.nn.Parameter(torch.zeros(1))

        def forward(self, *args, **kwargs):
            raise RuntimeError("the stubbed timm vision tower was run")

    return StubbedTimmTower()


def timm_missing() -> bool:
    import importlib.util

    return importlib.util.find_spec("timm") is None


class _timm_towers_stubbed:
    """Within it, transformers' timm wrapper builds ``_stubbed_timm_tower()`` when timm is not installed (no effect
    otherwise). Architectures built this way carry ``TIMM_STUB_NOTE`` in the table."""

    def __enter__(self):
        self.saved = None
        if not timm_missing():
            return self
        try:
            from transformers.models.timm_wrapper import modeling_timm_wrapper as wrapper
        except ImportError:
            return self
        self.wrapper = wrapper
        self.saved = wrapper.requires_backends, wrapper._create_timm_model_with_error_handling
        wrapper.requires_backends = lambda *args, **kwargs: None
        wrapper._create_timm_model_with_error_handling = lambda *args, **kwargs: _stubbed_timm_tower()
        return self

    def __exit__(self, *exc):
        if self.saved is not None:
            self.wrapper.requires_backends, self.wrapper._create_timm_model_with_error_handling = self.saved
        return False


def _uses_stubbed_tower(model) -> bool:
    return any(type(module).__name__ == "StubbedTimmTower" for module in model.modules())


def _inputs(batch: int):
    import torch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 120, (batch, PROMPT), generator=g)
    mask = torch.ones_like(ids)
    if batch > 1:
        ids[1, :4], mask[1, :4] = 0, 0
    return ids, mask


def _pixel_values(target, batch: int):
    """A VisionEncoderDecoderModel's encoder input, pixel_values [batch, C, H, W] of its encoder config's size, or
    None for the other models."""
    import torch

    if getattr(target.config, "model_type", None) != "vision-encoder-decoder":
        return None
    encoder = target.config.encoder
    size = encoder.image_size if isinstance(encoder.image_size, (list, tuple)) else (encoder.image_size,) * 2
    return torch.randn(batch, encoder.num_channels, *size, generator=torch.Generator().manual_seed(0))


def _reason(refusal: ValueError) -> str:
    """The reason of a capability refusal, without the "<Model> cannot be driven exactly ...:" preamble."""
    text = str(refusal)  # ("target: " / "draft_model: " may precede it, naming the argument)
    return re.sub(r"^.*?cannot be driven exactly by speculative_kernels[^:]*: ", "", text, count=1)


def _run(target, drafts, kind: str, column: str) -> str:
    """The first draft that causes rejections decides the cell."""
    for draft in drafts:
        cell = _run_one(target, draft, kind, column)
        if cell != "not checked: the draft accepted everything":
            return cell
    return cell


def _run_one(target, draft, kind: str, column: str) -> str:
    import torch

    import speculative_kernels as sk
    from speculative_kernels.generation.capabilities import (check_masked_slots, check_request, check_window_applied,
                                                             request_path)
    from speculative_kernels import CompileOptions

    if column.startswith("continuous"):
        return _run_continuous(target, draft, static=column == "continuous_static")
    batch = 2 if column.startswith("batch2") else 1
    static = column in ("static", "compile", "batch2_static")
    compiled = column == "compile"
    path = request_path(static, compiled)
    ids, mask = _inputs(batch)
    try:
        specs = check_request(target, draft, path=path, batch=batch)
        # (refused for requests past the window only: this one passes it)
        check_window_applied(specs[0], PROMPT + NEW - 1)
        check_masked_slots(specs[0], mask)  # (refused for padded prompts only: GIT)
    except ValueError as error:
        return "refused: " + _reason(error)
    if getattr(target.config, "is_encoder_decoder", False):  # encoder input: right padding (the seq2seq mapping
        # also lists decoder-only audio/speech-to-text models, whose prompts are left-padded)
        mask = mask.flip(1)
        ids = ids.flip(1)
    pixels = _pixel_values(target, batch)
    if pixels is not None:  # a vision wrapper reads images (no mask)
        ids, mask = pixels, None
    common = dict(max_new_tokens=NEW, do_sample=False, pad_token_id=0, return_dict_in_generate=True,
                  output_logits=True, **({} if mask is None else {"attention_mask": mask}))
    try:
        with torch.no_grad():
            reference = target.generate(ids, **common)
    except Exception as error:  # noqa: BLE001
        _reraise_timeout(error)
        return "not checked: model.generate itself fails (" + _short(error) + ")"
    expected = reference.sequences
    stats = sk.SpeculationStats()
    extra = {"cache_implementation": "static"} if static else {}
    if compiled:
        extra["compile"] = CompileOptions(backend="aot_eager")
        torch._dynamo.reset()  # one process compiles every architecture: start each from dynamo's empty caches
    try:
        got = sk.generate(target, ids, draft_model=draft, num_speculative_tokens=GAMMA, speculation_stats=stats,
                          **common, **extra)
    except ValueError as error:
        return "ERROR (refused late): " + _short(error)
    except Exception as error:  # noqa: BLE001
        _reraise_timeout(error)
        return "ERROR: " + _short(error)
    got, logits = got.sequences, got.logits
    if got.shape != expected.shape or not torch.equal(got, expected):
        return "DIFFERENT"
    # The same tokens can hide other logits (a window or position applied otherwise, by the luck of one prompt's
    # argmaxes): the emitted tokens' logits must agree with model.generate's to within float32 rounding (measured
    # 9e-8 to 1.4e-6 of logits up to 5.5 on 11 families; the defects found so were 2.6e-3 to 0.1). Half precision:
    # the tokens alone.
    if next(target.parameters()).dtype == torch.float32:
        ours, theirs = torch.stack(logits, 1).float(), torch.stack(reference.logits, 1).float()
        # a row's steps up to its EOS (HF computes finished rows on, from the pad ids it feeds them; ours are zeros)
        eos = torch.as_tensor(target.generation_config.eos_token_id if target.generation_config.eos_token_id
                              is not None else [], dtype=torch.int64).flatten()
        new = expected[:, expected.shape[1] - ours.shape[1]:]
        ended = torch.isin(new, eos)
        live = (ended.long().cumsum(dim=1) - ended.long()) == 0
        off = ((ours - theirs).abs().nan_to_num(0.0).amax(dim=-1) * live).max().item()
        if os.environ.get("COVERAGE_PRINT_OFF"):
            print(f"[off] {type(target).__name__} {column} {off:.3g} of {theirs.abs().max().item():.3g}",
                  file=sys.stderr)
        if off > LOGIT_TOLERANCE * max(1.0, theirs.abs().nan_to_num(0.0).max().item()):
            return f"DIFFERENT (same tokens, logits off by {off:.2g})"
    if stats.acceptance_rate >= 1.0:
        return "not checked: the draft accepted everything"
    return "exact"


def _run_continuous(target, draft, static: bool = False) -> str:
    """Continuous batching (``SpeculativeDecoder.add_request``/``step``; dynamic cache, or the static one with rows
    for 4 requests): two requests of different lengths, the second joining after the first step; each must equal
    ``model.generate`` on it alone."""
    import torch

    import speculative_kernels as sk

    ids, _ = _inputs(2)
    prompts = [ids[0], ids[1, 4:]]
    try:
        caches = dict(cache_implementation="static", max_context=PROMPT + NEW, max_batch_size=4) if static else {}
        decoder = sk.SpeculativeDecoder(target, draft, num_speculative_tokens=GAMMA, **caches)
        requests = [decoder.add_request(prompts[0], max_new_tokens=NEW, do_sample=False)]
        decoder.step()
        requests.append(decoder.add_request(prompts[1], max_new_tokens=NEW, do_sample=False))
        while any(decoder.result(r).finish_reason is None for r in requests):
            decoder.step()
    except ValueError as error:  # add_request checks the request before it joins the batch
        return "refused: " + _reason(error)
    except Exception as error:  # noqa: BLE001
        _reraise_timeout(error)
        return "ERROR: " + _short(error)
    drafted = accepted = 0
    for prompt, request in zip(prompts, requests):
        result = decoder.result(request)
        try:
            with torch.no_grad():
                expected = target.generate(prompt[None], max_new_tokens=NEW, do_sample=False, pad_token_id=0)
        except Exception as error:  # noqa: BLE001 -- (e.g. a model that needs its image or audio input)
            _reraise_timeout(error)
            return "not checked: model.generate itself fails (" + _short(error) + ")"
        if result.finish_reason == "error":  # (a request whose step raised ends so; model.generate ran)
            return "ERROR: " + result.error
        if result.token_ids != expected[0, len(prompt):].tolist():
            return "DIFFERENT"
        drafted, accepted = drafted + result.drafted_tokens, accepted + result.accepted_tokens
    return "not checked: the draft accepted everything" if accepted >= drafted else "exact"


def sweep(types, out, timeout: int, dtype: str = "float32", attn: str | None = None) -> None:
    import torch
    from transformers.utils import logging

    logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    signal.signal(signal.SIGALRM, lambda *_: (_ for _ in ()).throw(Timeout()))
    from tiny_configs import NotChecked

    # Our own imports fail here, loudly, instead of inside the per-model try below (where they would read as "not
    # checked" for every architecture).
    import speculative_kernels  # noqa: F401
    from speculative_kernels.generation.capabilities import check_request, request_path  # noqa: F401
    from speculative_kernels.generation.settings import REFUSED_UNLESS  # noqa: F401
    from speculative_kernels import CompileOptions  # noqa: F401

    for model_type, kind in types:
        row = {"model_type": model_type, "kind": kind}
        start = time.time()
        signal.alarm(timeout)
        try:
            target, drafts = _models(model_type, kind, dtype, attn)
            row["architecture"] = type(target).__name__
            if _uses_stubbed_tower(target):
                row["note"] = TIMM_STUB_NOTE
            for column in COLUMNS:
                begin = time.time()
                row[column] = _run(target, drafts, kind, column)
                row.setdefault("column_seconds", {})[column] = round(time.time() - begin, 1)
        except NotChecked as error:
            row.update({c: "not checked: " + str(error) for c in COLUMNS if c not in row})
        except Timeout:
            row.update({c: f"not checked: over {timeout} s on the CPU" for c in COLUMNS if c not in row})
        except Exception as error:  # noqa: BLE001
            reason = (f"over {timeout} s on the CPU" if _wrapped_timeout(error) is not None
                      else "building the tiny model fails (" + _short(error) + ")")
            row.update({c: "not checked: " + reason for c in COLUMNS if c not in row})
        finally:
            signal.alarm(0)
        if "architecture" not in row:  # no tiny model: does generate's up-front check refuse the default config?
            for column in COLUMNS:
                refusal = _refused_by_default_config(model_type, kind, column)
                if refusal is not None:
                    row[column] = refusal
        row["seconds"] = round(time.time() - start, 1)
        print(json.dumps(row), file=out, flush=True)


def _refused_by_default_config(model_type: str, kind: str, column: str) -> str | None:
    """For an architecture whose tiny model cannot be built: the capability check (which reads only the config, the
    forward's signature and source) run on the default config's model built on the meta device. Returns the
    "refused: ..." cell, or None (accepted, or the default model cannot be built either: stays "not checked")."""
    import torch
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from speculative_kernels.generation.capabilities import check_request, request_path

    try:
        auto = _auto_class(kind)
        with torch.device("meta"):
            model = auto.from_config(CONFIG_MAPPING[model_type]())
    except Exception:  # noqa: BLE001 -- stays "not checked" with the tiny model's reason
        return None
    batch = 2 if column.startswith(("batch2", "continuous")) else 1  # (continuous batching: always a batch)
    path = request_path(column in ("static", "compile", "batch2_static", "continuous_static"), column == "compile")
    try:
        check_request(model, model, path=path, batch=batch)
    except ValueError as error:
        return f"refused: {_reason(error)} (checked on the default config: the tiny model cannot be built)"
    except Exception:  # noqa: BLE001
        return None
    return None


def _auto_class(kind: str):
    """The transformers auto class that builds a ``kind`` model ("causal", "seq2seq", "image-text")."""
    import transformers

    return {"causal": transformers.AutoModelForCausalLM, "seq2seq": transformers.AutoModelForSeq2SeqLM,
            "image-text": transformers.AutoModelForImageTextToText}[kind]


def all_types():
    """(model type, kind) for every causal-LM and seq2seq class, and every image-text-to-text class that neither
    mapping lists (Qwen2-VL, LLaVA, PaliGemma, ...: checked generating from text alone)."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
        MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
    )

    listed = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) | set(MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES)
    return ([(t, "causal") for t in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)]
            + [(t, "seq2seq") for t in sorted(MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES)]
            + [(t, "image-text") for t in sorted(set(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES) - listed)])


def _status(cell: str) -> str:
    for word in ("exact", "refused", "not checked"):
        if cell.startswith(word):
            return word
    return "defect"


def render(rows, version: str) -> str:
    counts = {c: {} for c in COLUMNS}
    for row in rows:
        for c in COLUMNS:
            status = _status(row[c])
            counts[c][status] = counts[c].get(status, 0) + 1
    lines = [
        "# Architecture coverage",
        "",
        f"Generated by `python benchmarks/coverage.py` over every causal-LM and seq2seq config class of transformers "
        f"{version}, and every image-text-to-text class that neither lists (Qwen2-VL, LLaVA, PaliGemma, ...: "
        f"generating from text) (tiny random weights: hidden 32, 2 layers, vocab 128; sliding windows 6 with "
        f"10-token prompts, so they bind; {NEW} new tokens, gamma {GAMMA}; greedy). Do not edit by hand: rerun the script.",
        "",
        "* **exact**: greedy output identical to `model.generate`, with an imperfect draft (the target plus noise) "
        "that causes rejections;",
        "* **refused**: `generate` raises a `ValueError` naming the architecture and the reason before allocating "
        "anything (`speculative_kernels/generation/capabilities.py`);",
        "* **refused ... (checked on the default config)**: the tiny model cannot be built, but the same up-front "
        "check refuses the architecture's default config (a model built on the meta device: the check reads only "
        "the config and the forward);",
        "* **not checked**: the tiny model or HF's own `generate` cannot be built or run generically, and the "
        "check does not refuse the default config (reason given).",
        "",
        "`compile` uses the `aot_eager` backend on the CPU. Batch > 1: two rows, one left-padded by 4 tokens. "
        "`continuous`: continuous batching (`SpeculativeDecoder.add_request`/`step`; dynamic cache, or the static "
        "one with rows for 4 requests), two requests of 10 and 6 tokens, the second joining after the first step, "
        "each against `model.generate` on it alone.",
        "",
        *([f"**Partial sweep: {len(rows)} of {len(all_types())} config classes** (the run was cut short); "
           "rerun the script for the rest.", ""] if len(rows) < len(all_types()) else []),
        "## How each family is handled",
        "",
        "* **Full attention** (Llama, Qwen, GPT-2, OPT, ...; the decoders of BERT-like families with "
        "`is_decoder=True`): every path.",
        "* **Sliding windows** (Mistral, Mixtral, Starcoder2, Phi3, Qwen2 with windows; Gemma2/3, Cohere2, GPT-OSS "
        "interleaving local and global layers): the caches keep every slot (a rollback can restore what a window "
        "would have evicted) and the window is applied in the 4-D mask over each row's real positions (HF's rule "
        "`q - k < window`); models mixing both layer kinds get a dict of masks keyed by layer type. Every path.",
        "* **ALiBi from the mask** (Bloom, Falcon with `alibi=True`): they get the 2-D slot mask, from which they "
        "build per-row ALiBi over real positions and their causal mask. Every path.",
        "* **Positions from cache slots** (no `position_ids`: BART-style decoders used alone, MPT's ALiBi over key "
        "slots, ...; Llama 4's NoPE layers with attention temperature tuning, which scale queries by the cache's "
        "length, when `attention_chunk_size=None` makes every layer full attention): exact at batch 1 (no holes); "
        "batch > 1 is refused, since rejected drafts leave holes.",
        "* **Conv/SSM and hybrid models whose forward over several tokens continues the cached state** (Mamba2, "
        "Falcon-H1, Bamba, Granite 4 hybrids, Nemotron-H, Zamba2, Qwen3-Next, Qwen3.5, OLMo hybrid, LFM2, LFM2-MoE, "
        "LFM3, LFM2-VL, LFM3-VL): exact at batch 1 on the dynamic cache (`runners/recurrent.py`: the states are copied "
        "before each forward; a rollback restores the copy and cuts the attention layers' K/V, and the next forward "
        "feeds the kept tokens first). Configs without any attention layer run where transformers runs them (Mamba2, "
        "LFM3) and are refused elsewhere (transformers fails there, in model.generate too). Where Mamba2 mixers bound "
        "the step size dt (`time_step_limit`: Zamba2's and Nemotron-H's defaults), transformers clamps it in the scan "
        "over several tokens and not in the one-token step: the target's prompt forward keeps the clamp and gives the "
        "first token, and every later forward lifts it (`generation/step_size.py`), as model.generate's prefill and "
        "steps run (the tiny models here barely reach the bound; `tests/generation/test_recurrent_step_size.py` "
        "checks models that do). "
        "Batch > 1, the static cache and `compile=True` are refused by name: left padding and each row's own accepted "
        "count would reach the state.",
        "* **Mamba, Falcon-Mamba, Jamba**: refused by name. For a forward of more than one token over a cache their "
        "mixer runs the selective scan from a zero state and never reads the cached SSM state (only one-token steps "
        "do), so a verification forward would not continue it (Falcon-Mamba's logits differ by 6e-3 on the tiny "
        "model, Jamba's tokens on random ones; the tiny Mamba's state barely matters, but the same code path).",
        "* **Other recurrent models** (RWKV, xLSTM, RecurrentGemma, MiniMax, Kimi Linear, ...) and cache-less ones "
        "(OpenAI-GPT): refused. Their caches are their own, or their multi-token forward over a state is unchecked.",
        "* **K/V layouts on the static cache**: its buffers hold keys `[B, H_kv, C, D_k]` and values "
        "`[B, H_kv, C, D_v]` as the model writes them: multi-head latent attention (DeepSeek-V2/V3, Kimi K2.5, "
        "Mistral 4, MiniCPM3, GLM4-MoE-Lite, Longcat-Flash, ...) caches its two latents (`kv_lora_rank` and "
        "`qk_rope_head_dim` wide, one head), Falcon's multi-query attention one K/V head, and a heterogeneous config "
        "(`per_layer_config`: Step 3.7, Gemma 4's global layers) sizes each layer; layers that reuse another layer's "
        "K/V (Gemma 3n, Gemma 4: dummy cache layers) get no buffers. Every path.",
        "* **Rotary embeddings that follow the forward's longest position** (`rope_type` \"dynamic\" NTK scaling; "
        "\"longrope\" as in Phi-3/3.5/4-mini): exact while a request's prompt + max_new_tokens - 1 stays within the "
        "limit (`original_max_position_embeddings`; for \"dynamic\", `max_position_embeddings`); a request that can "
        "reach past it is refused by name (`capabilities.check_positions`), since past it the frequencies depend on "
        "the forward's longest position and a verification forward reaches positions a one-token step has not "
        "(HF's own Phi-3 `generate` recomputes its whole cache at that point; HF's assisted generation drifts there "
        "by 1e-3 on a tiny Phi-3). For \"longrope\", a prompt already past the limit in the first forward uses the "
        "long factors in every forward and is exact. The sweep's short requests stay within it.",
        "* **Multimodal models** (Gemma 3, Mllama, Qwen2-Audio, ...) generating from text: checked like the others, "
        "with every sub-config (text, vision, audio) shrunk the same way.",
        "* **Positions the model numbers itself** (Kosmos-2.5: its `prepare_inputs_for_generation` drops "
        "`position_ids`, and its forward counts positions from `padding_idx + 1` over the input ids, pad tokens "
        "skipped, plus the cache length): refused, since the runners pass explicit position ids, which such a forward "
        "reads as other rows of its table. The same rule in a forward that takes no `position_ids` (TrOCR's decoder "
        "with `use_learned_position_embeddings=False`, as its checkpoints set it): refused on every path, since a pad "
        "id inside a forward over several tokens shifts every later position, unlike in a one-token step (inside a "
        "VisionEncoderDecoderModel, whose decoder rows are hole-free, its sinusoids are read at each row's true "
        "positions, as M2M100's are: exact).",
        "* **Generic encoder-decoder wrappers** (EncoderDecoderModel, VisionEncoderDecoderModel, "
        "SpeechEncoderDecoderModel): driven by the seq2seq runners, each by the position rule of the decoder it "
        "wraps (`generation/wrapped_seq2seq.py`: BERT-like and GPT-2 decoders get each row's positions as "
        "`decoder_position_ids`, RoBERTa-like ones numbered from their pad id, TrOCR's and the BART family's tables "
        "read by hooks); other decoders, and a BERT-like decoder with `is_decoder=False`, are refused by name. The "
        "sweep builds them as from_encoder_decoder_pretrained does (causal decoder with cross-attention) and feeds "
        "the vision wrapper images. Every path but continuous batching.",
        "* **Classes with a generate() of their own** (MusicGen's codebook delay pattern, SeamlessM4T's target "
        "language, Granite Speech with PEFT adapters loaded): refused, naming the override, since "
        "`speculative_kernels.generate` would skip its extra steps. Overrides that only route audio inputs are "
        "reviewed and accepted (`GENERATE_ROUTES_INPUTS_ONLY`).",
        "* **Mixture-of-experts configs with `output_router_logits: true`** (a training run's load-balancing loss, kept "
        "in a fine-tune's config.json): the runners pass `output_router_logits=False` (`capabilities.forward_flags`); "
        "the router logits feed only that loss, never the logits. (model.generate runs such a config without an "
        "attention_mask and fails inside transformers with one.)",
        "",
        "## Summary",
        "",
        "| | " + " | ".join(HEADERS) + " |",
        "|---|" + "---|" * len(COLUMNS),
    ]
    for status in ("exact", "refused", "not checked", "defect"):
        lines.append(f"| {status} | " + " | ".join(str(counts[c].get(status, 0)) for c in COLUMNS) + " |")
    lines += ["", "## Per architecture"]
    titles = {"causal": "Causal-LM classes", "seq2seq": "Seq2seq classes",
              "image-text": "Image-text-to-text classes (generating from text)"}
    kind = None
    for row in rows:
        if row["kind"] != kind:
            kind = row["kind"]
            lines += ["", f"### {titles[kind]}", "", "| model type | architecture | " + " | ".join(HEADERS) + " |",
                      "|---|---|" + "---|" * len(COLUMNS)]
        cells = [row[c].replace("|", "/") for c in COLUMNS]
        if len(set(cells)) == 1 and not cells[0].startswith("exact"):
            cells = [cells[0]] + ["same"] * (len(cells) - 1)
        architecture = row.get("architecture", "") + (f" ({row['note']})" if row.get("note") else "")
        lines.append(f"| {row['model_type']} | {architecture} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="-", help="JSON lines output (default stdout)")
    parser.add_argument("--only", default=None, help="comma-separated model types")
    parser.add_argument("--kind", default=None, choices=("causal", "seq2seq", "image-text"),
                        help="only the architectures of this kind")
    parser.add_argument("--timeout", type=int, default=120, help="seconds per architecture")
    parser.add_argument("--shard", default="0/1", help="i/n: every n-th architecture from the i-th (parallel runs)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                        help="the models' weights (half precision: see docs/half_precision.md)")
    parser.add_argument("--attn", default=None, help="attention implementation (e.g. eager; default: transformers')")
    parser.add_argument("--render", default=None, help="render a JSON lines file into a Markdown table")
    parser.add_argument("--doc", default=None, help="write the rendered table here (default stdout)")
    args = parser.parse_args(argv)
    if args.render:
        import transformers

        rows = sorted((json.loads(line) for path in args.render.split(",") for line in open(path) if line.strip()),
                      key=lambda row: (row["kind"], row["model_type"]))
        text = render(rows, transformers.__version__)
        if args.doc:
            with open(args.doc, "w") as f:
                f.write(text)
        else:
            sys.stdout.write(text)
        return
    types = all_types()
    if args.only:
        wanted = set(args.only.split(","))
        types = [(t, k) for t, k in types if t in wanted]
    if args.kind:
        types = [(t, k) for t, k in types if k == args.kind]
    index, count = (int(x) for x in args.shard.split("/"))
    types = types[index::count]
    out = sys.stdout if args.out == "-" else open(args.out, "w")
    sweep(types, out, args.timeout, args.dtype, args.attn)


if __name__ == "__main__":
    main()
