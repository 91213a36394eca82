"""Encoder-decoder families beyond T5 and BART whose decoders the runners drive as they drive BART's (a position
table read at each row's true positions: Marian, Pegasus, Blenderbot, Blenderbot-Small, PLBart, MVP; M2M100/NLLB's
numbered from its ids): greedy tokens identical to ``model.generate`` at batch 1 and in a right-padded batch of 2, on
the dynamic and the static cache, with a draft the target rejects now and then."""

import pytest
import torch

import speculative_kernels as sk
from helpers.seq2seq_models import BART_LIKE, bart_like, source_batch, t5_like


@pytest.fixture(scope="module")
def pairs():
    """model_type -> (target, an unrelated smaller draft of the same family)."""
    return {kind: (bart_like(kind), bart_like(kind, layers=1, hidden=16, seed=123)) for kind in BART_LIKE}


@pytest.mark.parametrize("kind", sorted(BART_LIKE))
@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("lengths", [[7], [5, 9]])
def test_greedy_matches_hf(pairs, kind, cache, lengths):
    target, draft = pairs[kind]
    ids, mask = source_batch(lengths, seed=len(lengths), pad=target.config.pad_token_id)
    expected = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=16)
    stats = sk.SpeculationStats()
    got = sk.generate(target, ids, attention_mask=mask, draft_model=draft, num_speculative_tokens=3, do_sample=False,
                      max_new_tokens=16, speculation_stats=stats,
                      **({"cache_implementation": "static"} if cache == "static" else {}))
    assert torch.equal(got, expected), (got, expected)
    assert stats.accepted_histogram[0] > 0  # rejections rolled the caches back


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_m2m100_pad_tokens_in_the_decoder_prompt_as_in_hf(pairs, cache):
    """M2M100 (NLLB) numbers a pad token's position pad_token_id (its table's zero row) and the others from the pad
    id on: the trailing pad tokens of these decoder prompts take the zero row, as in model.generate."""
    target, draft = pairs["m2m_100"]
    ids, mask = source_batch([5, 9], seed=2, pad=1)
    decoder_ids = torch.tensor([[2, 5, 9, 1], [2, 7, 1, 1]])
    expected = target.generate(ids, attention_mask=mask, decoder_input_ids=decoder_ids, do_sample=False,
                               max_new_tokens=12)
    got = sk.generate(target, ids, attention_mask=mask, decoder_input_ids=decoder_ids, draft_model=draft,
                      num_speculative_tokens=3, do_sample=False, max_new_tokens=12,
                      **({"cache_implementation": "static"} if cache == "static" else {}))
    assert torch.equal(got, expected), (got, expected)


def test_m2m100_pad_token_before_another_in_the_decoder_prompt_is_refused(pairs):
    """HF's prompt forward numbers the tokens after a pad token by their non-pad rank, its later steps by position:
    refused by name rather than numbered otherwise."""
    target, draft = pairs["m2m_100"]
    with pytest.raises(ValueError, match=r"decoder_input_ids has the pad token \(1\) before another token: model "
                                         r"\(M2M100ForConditionalGeneration\)"):
        sk.generate(target, torch.tensor([[5, 6, 2]]), decoder_input_ids=torch.tensor([[2, 1, 5]]),
                    draft_model=draft, max_new_tokens=4)


@pytest.mark.parametrize("kind,cache", [("umt5", "dynamic"), ("umt5", "static"), ("longt5", "dynamic"),
                                        ("longt5", "static"), ("switch_transformers", "dynamic"),
                                        ("switch_transformers", "static")])
@pytest.mark.parametrize("lengths", [[7], [5, 9]])
def test_t5_like_greedy_matches_hf(kind, cache, lengths):
    """UMT5, LongT5 and Switch Transformers decoders: T5's relative position buckets, from slot offsets."""
    target = t5_like(kind)
    ids, mask = source_batch(lengths, seed=len(lengths), pad=0)
    kwargs = dict(attention_mask=mask, do_sample=False, max_new_tokens=16, eos_token_id=None)
    expected = target.generate(ids, **kwargs)
    stats = sk.SpeculationStats()
    got = sk.generate(target, ids, draft_model=t5_like(kind, layers=1, hidden=16, seed=123), num_speculative_tokens=3,
                      speculation_stats=stats, **kwargs,
                      **({"cache_implementation": "static"} if cache == "static" else {}))
    assert torch.equal(got, expected), (got, expected)
    assert stats.accepted_histogram[0] > 0  # rejections rolled the caches back


def test_umt5_rows_at_their_own_lengths_match_hf_on_the_static_cache():
    """Every UMT5 decoder layer computes its own relative bias (HF: from the cache's one offset); on the static cache
    each row sits at its own length, so each layer's bias is computed at each row's positions (a perturbed draft:
    rows accept different counts; with HF's shared-offset bias the batches of 2 and 3 gave other tokens). (compile=True
    runs the same hooks: checked by hand, 13 s here.)"""
    from helpers.models import perturbed

    target = t5_like("umt5")
    ids, mask = source_batch([3, 9, 6], seed=3, pad=0)
    kwargs = dict(attention_mask=mask, do_sample=False, max_new_tokens=16, eos_token_id=None)
    expected = target.generate(ids, **kwargs)
    stats = sk.SpeculationStats()
    got = sk.generate(target, ids, draft_model=perturbed(target, 0.1), num_speculative_tokens=3,
                      speculation_stats=stats, cache_implementation="static", **kwargs)
    assert torch.equal(got, expected), (got, expected)
    assert stats.accepted_histogram[0] > 0 and sum(stats.accepted_histogram[1:]) > 0


def test_umt5_decoder_prompt_run_without_a_causal_mask_is_refused():
    """transformers 5.17 builds UMT5's decoder self-attention with is_causal=False (5.24: True), so its
    model.generate runs a decoder prompt of several tokens without a causal mask (each token attends to the later
    ones: the differential harness's umt5 cases with decoder_input_ids differed under 5.17). Emulated by the
    attribute, which 5.24 reads alike: refused by name; the start token alone (one-token steps) still runs."""
    target = t5_like("umt5")
    for block in target.decoder.block:
        block.layer[0].SelfAttention.is_causal = False
    ids = torch.tensor([[6, 37, 28]])
    with pytest.raises(ValueError, match=r"decoder prompt of 3 tokens .*UMT5ForConditionalGeneration\)'s "
                                         r"model.generate runs it without a causal mask \(this transformers builds"):
        sk.generate(target, ids, decoder_input_ids=torch.tensor([[0, 56, 12]]), prompt_lookup_num_tokens=2,
                    max_new_tokens=4)
    kwargs = dict(do_sample=False, max_new_tokens=8, eos_token_id=None)
    assert torch.equal(sk.generate(target, ids, prompt_lookup_num_tokens=2, **kwargs), target.generate(ids, **kwargs))


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_switch_transformers_batch_whose_rows_leave_as_in_hf(cache):
    """Rows leaving the batch (and the static cache's padded source) rebuild the encoder output: Switch
    Transformers' forward reads its router_logits, which a plain BaseModelOutput lacks (AttributeError before)."""
    from helpers.models import perturbed

    target = t5_like("switch_transformers")
    ids, mask = source_batch([5, 9], seed=2, pad=0)
    expected = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=16)
    got = sk.generate(target, ids, attention_mask=mask, draft_model=perturbed(target, 0.1), num_speculative_tokens=3,
                      do_sample=False, max_new_tokens=16,
                      **({"cache_implementation": "static"} if cache == "static" else {}))
    assert torch.equal(got, expected), (got, expected)


def _tiny_bart_sized(model_type: str, **extra):
    """A one-layer, 16-wide model of ``model_type`` from BART's tiny sizes (pad 1, EOS and decoder start 2)."""
    from transformers import AutoConfig, AutoModelForSeq2SeqLM

    from helpers.seq2seq_models import VOCAB, _bart_kwargs

    config = AutoConfig.for_model(model_type, **_bart_kwargs(1, 16, VOCAB), **extra, pad_token_id=1, eos_token_id=2,
                                  decoder_start_token_id=2)
    return AutoModelForSeq2SeqLM.from_config(config).eval()


def test_led_is_refused_with_its_reason():
    """LED's decoder builds no mask for a one-token forward, which then attends the static cache's unwritten slots
    (another last token than model.generate's, when it was accepted as 'absolute')."""
    model = _tiny_bart_sized("led", attention_window=4)
    with pytest.raises(ValueError, match=r"type 'led' \(LEDForConditionalGeneration\), which speculative_kernels does "
                                         r"not support: its decoder drops the attention mask in one-token forwards"):
        sk.generate(model, torch.tensor([[5, 6, 7]]), draft_model=model, max_new_tokens=4)


def test_nllb_moe_is_refused_with_its_reason():
    """NLLB-MoE's router reads the decoder mask's last row as padding flags: greedy tokens differed from
    model.generate in a right-padded batch of 2 with an unrelated draft, so the type is refused, saying why."""
    model = _tiny_bart_sized("nllb-moe", num_experts=2)
    with pytest.raises(ValueError, match=r"type 'nllb-moe' \(NllbMoeForConditionalGeneration\), which "
                                         r"speculative_kernels does not support: its router reads"):
        sk.generate(model, torch.tensor([[5, 6, 7]]), draft_model=model, max_new_tokens=4)


def test_m2m100_sampling_matches_the_target_distribution():
    """Whole continuations of 3 tokens over a vocabulary of 6 (the pad token among them, numbered at the zero row
    inside verification blocks) sampled as often as model.generate's step-by-step probabilities say (chi-square),
    the target language forced first as NLLB's generation config does."""
    import itertools

    import numpy as np
    from transformers.generation.logits_process import ForcedBOSTokenLogitsProcessor

    from helpers.stats import assert_matches

    vocab, new, rows = 6, 3, 6000
    target, draft = bart_like("m2m_100", vocab=vocab), bart_like("m2m_100", layers=1, vocab=vocab, seed=7)
    for model in (target, draft):
        model.generation_config.eos_token_id = None
        model.generation_config.forced_eos_token_id = None
    source = torch.tensor([[3, 4, 5, 3, 2]])
    seqs = torch.tensor(list(itertools.product(range(vocab), repeat=new)))
    with torch.no_grad():  # HF's one-token steps (its first forward over a whole sequence numbers pads otherwise)
        out = target(input_ids=source.expand(len(seqs), -1), decoder_input_ids=torch.full((len(seqs), 1), 2),
                     use_cache=True)
        logits = [out.logits[:, -1]]
        for t in range(new - 1):
            out = target(encoder_outputs=(out.encoder_last_hidden_state,), decoder_input_ids=seqs[:, t : t + 1],
                         past_key_values=out.past_key_values, use_cache=True)
            logits.append(out.logits[:, -1])
    forced = ForcedBOSTokenLogitsProcessor(5)
    logp = torch.zeros(len(seqs), dtype=torch.float64)
    for t in range(new):
        ids = torch.cat([torch.full((len(seqs), 1), 2), seqs[:, :t]], dim=1)
        step = forced(ids, logits[t].float().clone())
        logp += torch.log_softmax(step.double(), dim=-1).gather(1, seqs[:, t : t + 1]).squeeze(1)
    torch.manual_seed(1234)
    stats = sk.SpeculationStats()
    out = sk.generate(target, source.expand(rows, -1), draft_model=draft, num_speculative_tokens=2, do_sample=True,
                      top_k=0, max_new_tokens=new, speculation_stats=stats)
    assert 0 < stats.acceptance_rate < 1
    codes = (out[:, 1:].numpy() * vocab ** np.arange(new - 1, -1, -1)).sum(axis=1)
    assert_matches(np.bincount(codes, minlength=vocab**new), logp.exp().numpy())


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("lengths", [[7], [5, 9]])
def test_t5gemma_greedy_matches_hf(cache, lengths):
    """T5Gemma's decoder takes decoder_position_ids (each row's own) and has sliding-window layers (window 4 over 16
    new tokens: it binds), whose mask the runners build per layer type."""
    from helpers.seq2seq_models import t5gemma

    target = t5gemma()
    ids, mask = source_batch(lengths, seed=len(lengths), pad=0)
    kwargs = dict(attention_mask=mask, do_sample=False, max_new_tokens=16, eos_token_id=None)
    expected = target.generate(ids, **kwargs)
    stats = sk.SpeculationStats()
    got = sk.generate(target, ids, draft_model=t5gemma(seed=123), num_speculative_tokens=3, speculation_stats=stats,
                      **kwargs, **({"cache_implementation": "static"} if cache == "static" else {}))
    assert torch.equal(got, expected), (got, expected)
    assert stats.accepted_histogram[0] > 0  # rejections rolled the caches back


def _assert_greedy_with_rejections(target, lengths: list[int], pad: int, perturbation: float, cache: str) -> None:
    """Greedy tokens identical to ``target.generate``'s for a source batch of ``lengths`` (padded with ``pad``), with
    a draft perturbed by ``perturbation`` that the target rejects at least once (rows accept different counts)."""
    from helpers.models import perturbed

    ids, mask = source_batch(lengths, seed=len(lengths), pad=pad)
    kwargs = dict(attention_mask=mask, do_sample=False, max_new_tokens=16, eos_token_id=None)
    expected = target.generate(ids, **kwargs)
    stats = sk.SpeculationStats()
    got = sk.generate(target, ids, draft_model=perturbed(target, perturbation), num_speculative_tokens=3,
                      speculation_stats=stats, **kwargs,
                      **({"cache_implementation": "static"} if cache == "static" else {}))
    assert torch.equal(got, expected), (got, expected)
    assert stats.accepted_histogram[0] > 0  # rejections rolled the caches back


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("lengths", [[7], [3, 9, 6]])
def test_pegasus_x_greedy_matches_hf(cache, lengths):
    """Pegasus-X computes its decoder sinusoids from position ids (HF: one offset for the batch), recomputed by its
    own module at each row's positions; a perturbed draft, so rows accept different counts (with the shared offset
    the batches of 2 and 3 gave other tokens)."""
    from helpers.seq2seq_models import pegasus_x

    _assert_greedy_with_rejections(pegasus_x(), lengths, pad=0, perturbation=0.1, cache=cache)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("lengths", [[7], [3, 9, 6]])
def test_fsmt_greedy_matches_hf(cache, lengths):
    """FSMT (facebook/wmt19): its decoder called directly with the runners' causal mask, its sinusoid table read
    where model.generate's steps read it (transformers 5.17's steps read one position for every token, and so do
    we there), the table grown past its 8 positions (read at its first size's last row before: the grown table's
    num_embeddings stays as built); a perturbed draft, so rows accept different counts."""
    from helpers.seq2seq_models import fsmt

    # its table grows (FSMT's make_weight) past 8 positions
    _assert_greedy_with_rejections(fsmt(positions=8), lengths, pad=1, perturbation=0.3, cache=cache)


def test_fsmt_steps_are_read_as_counted_under_every_name_of_the_cache_length():
    """Whether FSMT's steps count positions is read from its table's forward: 5.24 takes ``cache_length``, 5.18-5.23
    ``past_key_values_length`` (the rule once read only the first: 5.18-5.23's steps were numbered as 5.17's, every
    greedy test above gave other tokens there, and CI ran them under 5.17 and 5.24 only); 5.17's takes neither. The
    installed table's form must count exactly where its decoder passes the cache's length."""
    import inspect

    from transformers.models.fsmt import modeling_fsmt

    from speculative_kernels.generation.runners.seq2seq_positions import takes_cache_length

    def five_24(self, input, *, cache_length: int = 0): ...
    def five_18(self, input, *, past_key_values_length: int = 0): ...
    def five_17(self, input, incremental_state=None, timestep=None): ...

    assert takes_cache_length(five_24) and takes_cache_length(five_18) and not takes_cache_length(five_17)
    decoder = inspect.getsource(modeling_fsmt.FSMTDecoder.forward)
    passes_length = "self.embed_positions(input_ids, " in decoder and "length" in decoder.split(
        "self.embed_positions(input_ids, ", 1)[1].split(")", 1)[0]
    assert takes_cache_length(modeling_fsmt.SinusoidalPositionalEmbedding.forward) == passes_length


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_fsmt_pad_tokens_generated_are_numbered_as_in_hf(cache):
    """FSMT's one-token steps read a generated pad token at pad + its position (not the zero row, not as another
    token): a vocabulary of 6 whose greedy rows emit the pad token (1) 8 times, inside verification blocks."""
    from helpers.models import perturbed
    from helpers.seq2seq_models import fsmt

    target = fsmt(vocab=6, seed=2)
    ids = torch.randint(3, 6, (2, 6), generator=torch.Generator().manual_seed(2))
    ids[0, 4:] = 1
    kwargs = dict(attention_mask=(ids != 1).long(), do_sample=False, max_new_tokens=16, eos_token_id=None)
    expected = target.generate(ids, **kwargs)
    assert int((expected[:, 1:] == 1).sum()) >= 4
    got = sk.generate(target, ids, draft_model=perturbed(target, 0.1), num_speculative_tokens=3, **kwargs,
                      **({"cache_implementation": "static"} if cache == "static" else {}))
    assert torch.equal(got, expected), (got, expected)


def test_fsmt_source_and_target_vocabularies_of_other_sizes():
    """FSMT's source and target dictionaries are its own: a decoder start id past the source vocabulary is the
    target's (checked against the decoder's embedding, not model.get_input_embeddings, the encoder's), and prompt
    lookup does not propose source ids, which run past a smaller target vocabulary (IndexError in its decoder's
    embedding before)."""
    from helpers.seq2seq_models import fsmt

    kwargs = dict(do_sample=False, max_new_tokens=10, eos_token_id=None)
    target = fsmt(vocab=8, target_vocab=40)
    target.generation_config.decoder_start_token_id = 30
    ids = torch.tensor([[3, 4, 5, 6, 7, 3, 4]])
    expected = target.generate(ids, **kwargs)
    assert int(expected[0, 0]) == 30
    assert torch.equal(sk.generate(target, ids, draft_model=target, **kwargs), expected)
    target = fsmt(vocab=40, target_vocab=10)
    ids = torch.tensor([[token for t in range(10) for token in (t, 35)]])  # each target id, then a source-only id
    expected = target.generate(ids, **kwargs)
    assert torch.equal(sk.generate(target, ids, prompt_lookup_num_tokens=3, **kwargs), expected)


def test_fsmt_decoder_prompt_of_several_tokens_is_refused():
    """model.generate's first FSMT forward gets no causal mask (use_cache): a decoder prompt beyond the start token
    would attend to its later tokens there; refused by name."""
    from helpers.seq2seq_models import fsmt

    target = fsmt()
    with pytest.raises(ValueError, match=r"decoder_input_ids gives a decoder prompt of 3 tokens .*model "
                                         r"\(FSMTForConditionalGeneration\)'s model.generate runs it without a "
                                         r"causal mask"):
        sk.generate(target, torch.tensor([[5, 6, 2]]), decoder_input_ids=torch.tensor([[2, 7, 8]]),
                    prompt_lookup_num_tokens=2, max_new_tokens=4)


def _assert_logits_with_rows_of_other_lengths(target, ids, mask, max_new_tokens: int, cache: str) -> None:
    """Greedy tokens identical to ``target.generate``'s and every step's logits within 64 float32 ulps of its
    largest, with a perturbed draft that rows accept in different counts (some rejected, some accepted)."""
    from helpers.models import perturbed

    kwargs = dict(attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=None,
                  return_dict_in_generate=True, output_logits=True)
    expected = target.generate(ids, **kwargs)
    stats = sk.SpeculationStats()
    got = sk.generate(target, ids, draft_model=perturbed(target, 0.1), num_speculative_tokens=3,
                      speculation_stats=stats, **kwargs,
                      **({"cache_implementation": "static"} if cache == "static" else {}))
    assert torch.equal(got.sequences, expected.sequences)
    assert stats.accepted_histogram[0] > 0 and sum(stats.accepted_histogram[1:]) > 0  # rows of other lengths
    ours, theirs = torch.stack(got.logits), torch.stack(expected.logits)
    assert float((ours - theirs).abs().max()) <= 64 * torch.finfo(torch.float32).eps * float(theirs.abs().max())


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_t5gemma_rows_of_other_lengths_get_their_own_positions(cache):
    """Rotary attention sees only position differences, so HF's fallback for missing decoder_position_ids (the
    cache's length, one offset for the batch) is right wherever a row's offset from it never changes: at batch 1
    always, in a batch while every row accepts alike. A perturbed draft makes rows accept different counts; without
    decoder_position_ids the logits (max |logit| 0.42) were then 3e-4 to 8e-4 off HF's (tokens still equal: the
    tiny model's gaps are wider), with them within float32 rounding (1.2e-7)."""
    from helpers.seq2seq_models import t5gemma

    ids, mask = source_batch([3, 9, 6], seed=3, pad=0)
    _assert_logits_with_rows_of_other_lengths(t5gemma(), ids, mask, max_new_tokens=16, cache=cache)


@pytest.mark.parametrize("attention,cache,masked", [("eager", "dynamic", True), ("sdpa", "dynamic", True),
                                                    ("sdpa", "static", True), ("sdpa", "dynamic", False)])
def test_t5gemma2_matches_hf(attention, cache, masked):
    """T5Gemma 2's decoder concatenates its self- and cross-attention masks for one merged attention: under sdpa
    transformers' own cross mask is bool, which concatenated to the runners' additive self mask read as a bias of 1
    on every source key (logits 0.35-0.54 off, other tokens, batch 1 too); the runners give an additive cross mask,
    also where the request has none. Logits within float32 rounding of model.generate's, rows of other lengths."""
    from helpers.seq2seq_models import t5gemma2

    ids, mask = source_batch([3, 9, 6] if masked else [6, 6], seed=3, pad=0)
    _assert_logits_with_rows_of_other_lengths(t5gemma2(attention=attention), ids, mask if masked else None,
                                              max_new_tokens=12, cache=cache)


def _switch_with_capacity(capacity):
    target = t5_like("switch_transformers")
    target.config.expert_capacity = capacity
    for module in target.modules():
        if hasattr(module, "expert_capacity"):
            module.expert_capacity = capacity
    return target


@pytest.mark.parametrize("capacity,gamma", [(3, 2), (2, 1)])
def test_switch_transformers_within_its_expert_capacity_matches_hf(capacity, gamma):
    """Switch Transformers' experts take at most expert_capacity tokens of one forward and drop the rest; while every
    forward (gamma + 1 tokens) stays within it, no token is dropped and the tokens are model.generate's."""
    from helpers.models import perturbed

    target = _switch_with_capacity(capacity)
    ids, mask = source_batch([5, 9], seed=2, pad=0)
    kwargs = dict(attention_mask=mask, do_sample=False, max_new_tokens=16, eos_token_id=None)
    got = sk.generate(target, ids, draft_model=perturbed(target, 0.05), num_speculative_tokens=gamma, **kwargs)
    assert torch.equal(got, target.generate(ids, **kwargs))


def test_switch_transformers_forwards_past_its_expert_capacity_are_refused():
    """A verification of gamma + 1 tokens past expert_capacity would drop tokens that model.generate's one-token
    steps keep (capacity 3, gamma 4: 7 of 32 tokens differed, silently): refused by name, and so is a decoder prompt
    longer than the capacity (model.generate's first forward drops there, the split prompt forwards of the loop
    would not drop alike)."""
    from helpers.models import perturbed

    target = _switch_with_capacity(3)
    draft = perturbed(target, 0.05)
    ids = torch.tensor([[5, 6, 7, 8]])
    with pytest.raises(ValueError, match=r"expert_capacity=3 .* reach 5 tokens .*num_speculative_tokens < 3"):
        sk.generate(target, ids, draft_model=draft, num_speculative_tokens=4, max_new_tokens=8)
    with pytest.raises(ValueError, match=r"expert_capacity=3 .* reach 4 tokens .*a prompt of 4"):
        sk.generate(target, ids, decoder_input_ids=torch.tensor([[0, 5, 6, 7]]), draft_model=draft,
                    num_speculative_tokens=2, max_new_tokens=8)


@pytest.mark.parametrize("given", ["BaseModelOutput", "tuple"])
def test_switch_transformers_encoder_outputs_without_router_logits_are_refused_by_name(given):
    """Switch Transformers' forward reads encoder_outputs.router_logits: a BaseModelOutput (or a tuple) failed inside
    transformers with an AttributeError (model.generate fails alike); now a TypeError naming encoder_outputs. Its
    encoder's own output still runs, identical to model.generate."""
    from transformers.modeling_outputs import BaseModelOutput

    target = t5_like("switch_transformers")
    ids, mask = source_batch([6, 4], seed=3)
    with torch.no_grad():
        own = target.get_encoder()(input_ids=ids, attention_mask=mask, return_dict=True)
    hidden = own.last_hidden_state
    plain = BaseModelOutput(last_hidden_state=hidden) if given == "BaseModelOutput" else (hidden,)
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, prompt_lookup_num_tokens=2)
    with pytest.raises(TypeError, match="encoder_outputs .*router_logits"):
        sk.generate(target, ids, encoder_outputs=plain, **kwargs)
    hf_kwargs = {k: v for k, v in kwargs.items() if k != "prompt_lookup_num_tokens"}
    assert torch.equal(sk.generate(target, ids, encoder_outputs=own, **kwargs),
                       target.generate(ids, encoder_outputs=own, **hf_kwargs))
