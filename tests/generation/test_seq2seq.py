"""Encoder-decoder models (T5, BART, mBART): greedy identical to HF, sampling exact, batches, inputs, errors, CLI."""

import itertools

import numpy as np
import pytest
import torch
from transformers import ProphetNetConfig, ProphetNetForConditionalGeneration
from transformers.generation.logits_process import ForcedBOSTokenLogitsProcessor, LogitsProcessorList
from transformers.generation.utils import GenerateEncoderDecoderOutput

import speculative_kernels as sk
from helpers.float_error import assert_logits_as_accurate_as_hf
from helpers.host_reads import step_reading_once
from helpers.models import llama
from helpers.sampling import hf_warpers
from helpers.seq2seq_models import SEQ2SEQ_FAMILIES, bart, save_t5_pair, seq2seq_drafts_for, source_batch, t5
from helpers.stats import assert_matches


@pytest.fixture(scope="module")
def pairs():
    """family -> (target, {draft kind: draft})."""
    out = {}
    for family, make in SEQ2SEQ_FAMILIES.items():
        target = make()
        out[family] = (target, seq2seq_drafts_for(family, target))
    return out


def _assert_same_as_hf(target, draft, ids, mask, gamma, **kwargs):
    """Sequences identical to ``target.generate``, raw logits and scores as accurate as HF's (``float_error``)."""
    kwargs = dict(attention_mask=mask, do_sample=False, return_dict_in_generate=True, output_logits=True,
                  output_scores=True, **kwargs)
    expected = target.generate(ids, **kwargs)
    stats = sk.SpeculationStats()
    got = sk.generate(target, ids, draft_model=draft, num_speculative_tokens=gamma, speculation_stats=stats, **kwargs)
    assert isinstance(got, GenerateEncoderDecoderOutput) and got.speculation_stats is not None
    assert torch.equal(got.sequences, expected.sequences), (got.sequences, expected.sequences)
    live = _live_steps(got.sequences[:, -len(got.logits):], kwargs.get("eos_token_id",
                                                                       target.generation_config.eos_token_id))
    decoder_mask = {k: kwargs[k] for k in ("decoder_attention_mask",) if k in kwargs}
    assert_logits_as_accurate_as_hf(target, got, expected, live, input_ids=ids, attention_mask=mask, **decoder_mask)
    return got, stats


def _live_steps(new_tokens, eos):
    """[B, steps] bool: the steps at which a row was still generating (HF goes on computing finished rows)."""
    eos = torch.tensor([] if eos is None else [eos] if isinstance(eos, int) else list(eos), dtype=torch.int64)
    ended = torch.isin(new_tokens, eos).to(torch.int64).cumsum(dim=1)
    return (ended - torch.isin(new_tokens, eos).to(torch.int64)) == 0


@pytest.mark.parametrize("family", sorted(SEQ2SEQ_FAMILIES))
@pytest.mark.parametrize("draft_kind", ["self", "perturbed", "unrelated"])
@pytest.mark.parametrize("gamma", [1, 4])
def test_greedy_matches_hf(pairs, family, draft_kind, gamma):
    target, drafts = pairs[family]
    ids, mask = source_batch([7], pad=target.config.pad_token_id)
    _assert_same_as_hf(target, drafts[draft_kind], ids, mask, gamma, max_new_tokens=20)


@pytest.mark.parametrize("family", sorted(SEQ2SEQ_FAMILIES))
@pytest.mark.parametrize("lengths,draft_kind", [([5, 9], "perturbed"), ([3, 8, 6, 1], "unrelated"),
                                                ([4, 4, 7, 2, 9, 5], "perturbed")])
def test_batched_greedy_matches_hf_per_row(pairs, family, lengths, draft_kind):
    target, drafts = pairs[family]
    ids, mask = source_batch(lengths, seed=len(lengths), pad=target.config.pad_token_id)
    _, stats = _assert_same_as_hf(target, drafts[draft_kind], ids, mask, 3, max_new_tokens=16)
    if draft_kind == "perturbed":  # rows accepted different counts: their caches were shifted apart
        assert sum(1 for n in stats.accepted_histogram if n) > 1


def test_mt5_batch_matches_hf():
    target = t5(mt5=True)
    assert target.config.model_type == "mt5"
    ids, mask = source_batch([5, 9, 3])
    _assert_same_as_hf(target, t5(layers=1, hidden=16, seed=5, mt5=True), ids, mask, 3, max_new_tokens=12)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_a_source_row_with_no_real_token_as_in_hf(attention, cache):
    """A source row whose attention_mask is all zeros: HF's sdpa cross-attention mask is boolean and SDPA gives such
    a row zero attention, its eager one additive (every source state weighted alike). The runners pass the mask in
    the form HF builds for the model's attention (they passed the additive one to sdpa: other tokens, silently)."""
    from helpers.models import perturbed
    from helpers.seq2seq_models import bart

    target = bart()
    target.set_attn_implementation(attention)
    draft = perturbed(target, scale=0.3)
    ids = torch.randint(3, 97, (3, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.tensor([[1] * 9, [0] * 9, [0] * 4 + [1] * 5])
    kwargs = dict(attention_mask=mask, max_new_tokens=10, do_sample=False)
    static = dict(cache_implementation="static") if cache == "static" else {}
    want = target.generate(ids, **kwargs, **static)
    assert torch.equal(sk.generate(target, ids, draft_model=draft, num_speculative_tokens=3, **kwargs, **static), want)


def test_no_input_ids_starts_one_bos_per_row_of_the_tensors_given(pairs):
    """No input_ids: HF encodes one bos per row of the first tensor given (attention_mask [B, 1], decoder_input_ids
    [B, L], decoder_attention_mask [B, 1]: the start token's mask), one row without any (a batch of 2 was refused:
    'the encoder input has (1, 1)'; a decoder_attention_mask without decoder_input_ids was refused)."""
    target, drafts = pairs["bart"]
    draft = next(iter(drafts.values()))
    common = dict(max_new_tokens=6, do_sample=False)
    for given in (dict(attention_mask=torch.ones(2, 1, dtype=torch.int64)),
                  dict(decoder_input_ids=torch.tensor([[2, 17, 40], [2, 63, 8]])),
                  dict(decoder_attention_mask=torch.ones(3, 1, dtype=torch.int64)), {}):
        want = target.generate(**given, **common)
        assert torch.equal(sk.generate(target, draft_model=draft, num_speculative_tokens=3, **given, **common), want)


def test_token_id_settings_as_numpy_values_and_tensors_as_in_hf(pairs):
    """mBART-50 users pass the target language id as read from an array or a tensor: forced_bos_token_id /
    forced_eos_token_id as a numpy integer or a tensor (they crashed in our logit masks without naming the
    argument), eos_token_id and decoder_start_token_id as numpy arrays (refused)."""
    import numpy as np

    target, drafts = pairs["mbart"]
    draft = next(iter(drafts.values()))
    ids, mask = source_batch([7, 3], pad=1, seed=20)
    for given in (dict(forced_bos_token_id=np.int64(7)), dict(forced_bos_token_id=torch.tensor([[5, 7]])[0, 1]),
                  dict(forced_eos_token_id=torch.tensor([9, 10])), dict(eos_token_id=np.array([2, 9])),
                  dict(decoder_start_token_id=np.array([2, 2])), dict(forced_bos_token_id=np.array(7)),
                  dict(eos_token_id=np.array(2))):
        common = dict(attention_mask=mask, do_sample=False, max_new_tokens=8, **given)
        assert torch.equal(sk.generate(target, ids, draft_model=draft, **common), target.generate(ids, **common))


def test_self_draft_accepts_everything(pairs):
    target, _ = pairs["bart"]
    ids, mask = source_batch([5, 3, 6], pad=1)
    _, stats = _assert_same_as_hf(target, target, ids, mask, 3, max_new_tokens=12, forced_eos_token_id=None,
                                  eos_token_id=None)
    assert stats.acceptance_rate == 1.0 and stats.accepted_histogram == [0, 0, 0, 3 * 3]


def test_rows_finish_at_different_times(pairs):
    target, drafts = pairs["t5"]
    ids, mask = source_batch([6, 4, 7, 5], seed=2)
    free = target.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, eos_token_id=None)
    eos = int(free[1, 1])  # row 1's very first new token becomes EOS
    got, stats = _assert_same_as_hf(target, drafts["unrelated"], ids, mask, 4, max_new_tokens=10, eos_token_id=eos)
    rows = got.sequences[:, 1:].tolist()
    assert rows[1][0] == eos and all(t == 0 for t in rows[1][1:])
    assert stats.new_tokens == sum(row.index(eos) + 1 if eos in row else len(row) for row in rows)
    assert len({row.index(eos) if eos in row else len(row) for row in rows}) > 1
    assert stats.dropped_rows > 0  # the finished rows left the batch (caches and encoder outputs selected)


def test_a_long_batch_keeps_its_decoder_cache_as_wide_as_its_longest_row(pairs, monkeypatch):
    """The decoder cache of a batch is cut on the left to a host bound, which added the batch's largest kept count
    at every rollback: with rows keeping different counts it outgrew every row (BART: width 257 for rows of at most
    201 tokens), and BART, which reads its position table at the cache's width before the hook replaces it, raised
    IndexError past its 256 positions where model.generate runs. The rows' counts ride along the iteration's host
    read and tighten the bound: the width stays within the longest row plus a few verification blocks."""
    from speculative_kernels.generation.runners import seq2seq as runners

    target, drafts = pairs["bart"]
    ids, mask = source_batch([5, 9, 3, 12], seed=0, pad=1)
    excess = []
    real = runners.Seq2SeqRunner._call_model

    def spy(self, tokens, decoder_mask):
        excess.append(self.width + tokens.shape[1] - int(self.next_position.max()) - tokens.shape[1])
        return real(self, tokens, decoder_mask)

    monkeypatch.setattr(runners.Seq2SeqRunner, "_call_model", spy)
    # (250 new tokens: within the 256 positions with the 4 drafted ones the up-front check allows; the cache, a few
    #  blocks wider than the longest row, passes the table's end: HF's own lookup, which the hook replaces, starts
    #  from 0 there, a pre-hook's doing)
    expected = target.generate(ids, attention_mask=mask, max_new_tokens=250, do_sample=False)
    got = sk.generate(target, ids, attention_mask=mask, draft_model=drafts["perturbed"], num_speculative_tokens=4,
                      max_new_tokens=250, do_sample=False)
    assert torch.equal(got, expected)
    assert max(excess) <= 3 * (4 + 1)  # (a few verification blocks; the old code reached 56 slots past the row)


@pytest.mark.parametrize("family", ["bart", "mbart"])
def test_forced_bos_and_eos(pairs, family):
    target, drafts = pairs[family]
    ids, mask = source_batch([6, 3], pad=1)
    got, _ = _assert_same_as_hf(target, drafts["unrelated"], ids, mask, 3, max_new_tokens=7,
                                forced_bos_token_id=42, forced_eos_token_id=[2, 7], eos_token_id=None)
    assert got.sequences[:, 1].tolist() == [42, 42]
    assert set(got.sequences[:, -1].tolist()) <= {2, 7}
    assert torch.isinf(got.scores[0][:, :42]).all() and (got.scores[0][:, 42] == 0).all()


def test_forced_eos_in_a_decoder_only_model():
    target, draft = llama(), llama(layers=1, seed=3)
    ids = torch.randint(3, 97, (1, 5), generator=torch.Generator().manual_seed(0))
    kwargs = dict(max_new_tokens=9, do_sample=False, forced_eos_token_id=2, forced_bos_token_id=4)
    expected = target.generate(ids, **kwargs)
    got = sk.generate(target, ids, draft_model=draft, num_speculative_tokens=3, **kwargs)
    assert torch.equal(got, expected) and got[0, -1] == 2


def test_decoder_input_ids_as_in_hf(pairs):
    target, drafts = pairs["t5"]
    ids, mask = source_batch([5, 8], pad=0)
    for decoder_ids in (torch.tensor([[0, 17, 23], [0, 40, 41]]), torch.tensor([[17, 23], [40, 41]])):
        got, _ = _assert_same_as_hf(target, drafts["perturbed"], ids, mask, 3, max_new_tokens=9,
                                    decoder_input_ids=decoder_ids)
        assert got.sequences.shape == (2, 3 + 9)


def test_padded_decoder_prompt_as_in_hf(pairs):
    target, drafts = pairs["bart"]
    ids, mask = source_batch([5, 8], pad=1)
    decoder_ids = torch.tensor([[2, 1, 30, 31], [2, 50, 51, 52]])
    decoder_mask = torch.tensor([[1, 0, 1, 1], [1, 1, 1, 1]])
    _assert_same_as_hf(target, drafts["perturbed"], ids, mask, 3, max_new_tokens=9, decoder_input_ids=decoder_ids,
                       decoder_attention_mask=decoder_mask)


def test_encoder_outputs_given(pairs):
    target, drafts = pairs["bart"]
    ids, mask = source_batch([6, 4], pad=1)
    expected = target.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    encoded = target.get_encoder()(input_ids=ids, attention_mask=mask)
    for draft, kwargs in ((target, {}), (drafts["unrelated"], dict(input_ids=ids))):
        got = sk.generate(target, draft_model=draft, encoder_outputs=encoded, attention_mask=mask,
                          max_new_tokens=8, do_sample=False, **kwargs)
        assert torch.equal(got, expected)
    with pytest.raises(ValueError, match="encoder_outputs alone"):
        sk.generate(target, draft_model=drafts["unrelated"], encoder_outputs=encoded, attention_mask=mask)


def test_outputs_are_ordinary_tensors_as_in_hf(pairs):
    """As model.generate's (run under no_grad): editable in place and usable in autograd (an inference tensor is
    neither)."""
    target, drafts = pairs["t5"]
    ids, mask = source_batch([5, 3])
    out = sk.generate(target, ids, attention_mask=mask, draft_model=drafts["perturbed"], max_new_tokens=5,
                      return_dict_in_generate=True, output_scores=True)
    for tensor in (out.sequences, *out.scores):
        assert not tensor.is_inference()
        tensor[..., -1:] = tensor[..., -1:]
    target(input_ids=ids, attention_mask=mask, labels=out.sequences[:, 1:].contiguous()).loss.backward()


def test_max_new_tokens_zero_returns_the_decoder_prompt(pairs):
    target, _ = pairs["t5"]
    ids, _ = source_batch([4])
    assert sk.generate(target, ids, draft_model=target, max_new_tokens=0).tolist() == [[0]]


def test_decoder_session_steps(pairs):
    target, drafts = pairs["t5"]
    ids, mask = source_batch([5, 7], pad=0)
    expected = target.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=None)
    session = sk.SpeculativeDecoder(target, drafts["perturbed"], num_speculative_tokens=3).start(
        ids, attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=None)
    while not session.finished:
        session.step()
    assert torch.equal(session.sequences(), expected)


@pytest.mark.parametrize("family,lengths", [("t5", [6]), ("t5", [6, 4, 5]), ("bart", [6, 4, 5])])
def test_one_host_read_per_iteration(pairs, family, lengths):
    target, drafts = pairs[family]
    ids, mask = source_batch(lengths, pad=target.config.pad_token_id)
    session = sk.SpeculativeDecoder(target, drafts["perturbed"], num_speculative_tokens=3).start(
        ids, attention_mask=mask, max_new_tokens=12, do_sample=True, top_k=20)
    steps = step_reading_once(session)
    assert steps > 1


# ------------------------------------------------------------------------------------------------ sampling
VOCAB, NEW, ROWS = 6, 3, 6000


# Output scales giving a spread continuation distribution (tens of likely cells) and acceptance around 0.4.
LOGIT_SCALE = {"t5": 0.3, "bart": 2.0, "mbart": 1.0}


def _peaky(family, seed, layers, forced_bos=None):
    model = SEQ2SEQ_FAMILIES[family](layers=layers, vocab=VOCAB, seed=seed)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(LOGIT_SCALE[family])
    model.generation_config.eos_token_id = None
    model.generation_config.forced_eos_token_id = None
    model.generation_config.forced_bos_token_id = forced_bos
    return model


def _continuation_probs(model, source, processors):
    """Exact probability of every continuation of NEW decoder tokens under HF's processing, by enumeration."""
    seqs = torch.tensor(list(itertools.product(range(VOCAB), repeat=NEW)))
    start = torch.full((len(seqs), 1), model.generation_config.decoder_start_token_id)
    decoder_ids = torch.cat([start, seqs], dim=1)
    with torch.no_grad():
        logits = model(input_ids=source.expand(len(seqs), -1), decoder_input_ids=decoder_ids).logits.float()
    logp = torch.zeros(len(seqs), dtype=torch.float64)
    for t in range(NEW):
        step = processors(decoder_ids[:, : t + 1], logits[:, t].clone())
        logp += torch.log_softmax(step.double(), dim=-1).gather(1, seqs[:, t : t + 1]).squeeze(1)
    return logp.exp().numpy()


@pytest.mark.parametrize(
    "family,temperature,top_k,top_p,gamma,forced_bos",
    [("t5", 1.0, 0, 1.0, 2, None), ("t5", 0.8, 3, 1.0, 3, None), ("bart", 1.0, 0, 0.8, 2, None),
     ("mbart", 1.2, 0, 1.0, 2, 5)],
)
def test_whole_continuations_match_target_sampling(family, temperature, top_k, top_p, gamma, forced_bos):
    target, draft = _peaky(family, 0, 2, forced_bos), _peaky(family, 7, 1, forced_bos)
    source = torch.tensor([[3, 4, 5, 3, 2]])
    processors = hf_warpers(temperature, top_k, top_p)
    if forced_bos is not None:
        processors.insert(0, ForcedBOSTokenLogitsProcessor(forced_bos))
    probs = _continuation_probs(target, source, LogitsProcessorList(processors))
    torch.manual_seed(1234)
    stats = sk.SpeculationStats()
    out = sk.generate(target, source.expand(ROWS, -1), draft_model=draft, num_speculative_tokens=gamma,
                      do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=NEW,
                      speculation_stats=stats)
    assert 0 < stats.acceptance_rate < 1
    new = out[:, 1:].numpy()
    codes = (new * VOCAB ** np.arange(NEW - 1, -1, -1)).sum(axis=1)
    assert_matches(np.bincount(codes, minlength=VOCAB**NEW), probs)


# ------------------------------------------------------------------------------------------------ errors
def test_mixed_pairs_are_refused():
    with pytest.raises(ValueError, match="encoder-decoder model but draft_model is a decoder-only"):
        sk.generate(t5(), torch.tensor([[5, 6]]), draft_model=llama())
    with pytest.raises(ValueError, match="decoder-only model but draft_model is an encoder-decoder"):
        sk.generate(llama(), torch.tensor([[5, 6]]), draft_model=t5())


def test_different_vocabularies_are_refused():
    with pytest.raises(ValueError, match="different vocabularies"):
        sk.generate(t5(), torch.tensor([[5, 6]]), draft_model=t5(layers=1, vocab=120))


def test_unsupported_architecture_is_named():
    config = ProphetNetConfig(vocab_size=97, hidden_size=16, num_encoder_layers=1, num_decoder_layers=1,
                              num_encoder_attention_heads=2, num_decoder_attention_heads=2, encoder_ffn_dim=32,
                              decoder_ffn_dim=32, pad_token_id=0, decoder_start_token_id=0)
    prophetnet = ProphetNetForConditionalGeneration(config).eval()
    with pytest.raises(ValueError, match="type 'prophetnet' .* its decoder takes one token per forward"):
        sk.generate(prophetnet, torch.tensor([[5, 6]]), draft_model=prophetnet)


def test_bad_decoder_prompt(pairs):
    target, _ = pairs["t5"]
    ids, _ = source_batch([4, 4])
    with pytest.raises(ValueError, match="decoder_attention_mask must be 1 at the last"):
        sk.generate(target, ids, draft_model=target, decoder_input_ids=torch.tensor([[0, 5], [0, 6]]),
                    decoder_attention_mask=torch.tensor([[1, 1], [1, 0]]))
    with pytest.raises(ValueError, match="decoder_input_ids must be a \\[2, length\\]"):
        sk.generate(target, ids, draft_model=target, decoder_input_ids=torch.tensor([[0, 5]]))


# ------------------------------------------------------------------------------------------------ CLI
@pytest.fixture(scope="module")
def t5_dirs(tmp_path_factory):
    return save_t5_pair(tmp_path_factory.mktemp("t5pair"))


def test_cli_generate_compare_on_a_t5_pair(t5_dirs, capsys):
    from speculative_kernels.cli import main

    target, draft = t5_dirs
    code = main(["generate", "--target", str(target), "--draft", str(draft), "--prompt",
                 "translate English to German: the cat is small", "--max-new-tokens", "10", "--gamma", "3",
                 "--compare"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "acceptance rate" in out and "outputs identical" in out


def test_per_row_decoder_start_ids_follow_their_prompts_copies():
    """decoder_start_token_id=[one per prompt] with num_return_sequences=3: each prompt's copies start from its own
    start token, as in model.generate (it was refused: 'has 2 entries for a batch of 6')."""
    from helpers.models import perturbed

    target = t5()
    ids, mask = source_batch([6, 4], seed=3)
    kwargs = dict(attention_mask=mask, do_sample=True, top_k=1, num_return_sequences=3, max_new_tokens=6,
                  decoder_start_token_id=[0, 7])
    expected = target.generate(ids, **kwargs)
    got = sk.generate(target, ids, draft_model=perturbed(target, 0.1), seed=0, **kwargs)
    assert torch.equal(got, expected)  # (top_k=1: the sampled continuation is the greedy one)


def test_a_learned_position_table_too_short_for_the_request_is_refused_by_name():
    """BART's learned positions, the decoder's and the encoder's: a draft with a 32-position table and a request
    past it failed with an IndexError inside the embedding after some iterations (decoder) or in the draft's encoder;
    the target's table likewise. Refused up front naming the argument, as for decoder-only models."""
    from transformers import BartConfig, BartForConditionalGeneration

    from helpers.seq2seq_models import VOCAB, _bart_kwargs, bart

    target = bart()  # 256 positions
    settings = _bart_kwargs(1, 16, VOCAB) | dict(max_position_embeddings=32)
    torch.manual_seed(5)
    draft = BartForConditionalGeneration(BartConfig(**settings, bos_token_id=0, pad_token_id=1, eos_token_id=2,
                                                    decoder_start_token_id=2)).eval()
    short = torch.randint(3, VOCAB, (1, 10), generator=torch.Generator().manual_seed(0))
    long = torch.randint(3, VOCAB, (1, 40), generator=torch.Generator().manual_seed(1))
    kwargs = dict(draft_model=draft, num_speculative_tokens=3, eos_token_id=None, forced_eos_token_id=None)
    with pytest.raises(ValueError, match=r"draft_model \(BartForConditionalGeneration\) has a learned position "
                                         r"table of 32 positions, and this request reaches 40"):
        sk.generate(target, short, max_new_tokens=40, **kwargs)
    with pytest.raises(ValueError, match=r"draft_model .* encoder position table of 32 positions, and the encoder "
                                         r"input is 40 tokens long"):
        sk.generate(target, long, max_new_tokens=5, **kwargs)
    with pytest.raises(ValueError, match=r"model \(BartForConditionalGeneration\) has a learned position table of "
                                         r"256 positions, and this request reaches 300"):
        sk.generate(target, short, max_new_tokens=300, draft_model=bart(seed=1), eos_token_id=None)
    expected = target.generate(short, max_new_tokens=30, do_sample=False, eos_token_id=None,
                               forced_eos_token_id=None)
    assert torch.equal(sk.generate(target, short, max_new_tokens=30, do_sample=False, **kwargs), expected)


def test_a_max_length_the_decoder_prompt_fills_names_decoder_input_ids():
    """max_length counts the decoder sequence: HF's error names decoder_input_ids; ours named input_ids (the encoder
    input, of another length)."""
    target = t5()
    ids = torch.tensor([[5, 6, 7, 8]])
    with pytest.raises(ValueError, match="Input length of decoder_input_ids is 1, but `max_length` is set to 1"):
        target.generate(ids, max_length=1)
    with pytest.raises(ValueError, match="Input length of decoder_input_ids is 1, but `max_length` is set to 1"):
        sk.generate(target, ids, draft_model=t5(), max_length=1)


@pytest.mark.parametrize("family,cache", [("bart", None), ("t5", "static")])
def test_a_target_shared_with_another_thread_keeps_its_forwards_apart(family, cache):
    """The runners' position hooks sit on the model's shared submodules (BART's position table, T5's first decoder
    self-attention) during each forward: another thread's forward of the same model meanwhile (its model.generate,
    which HF allows) got this call's positions, silently other tokens (or a crash with T5's static cache). The hooks
    now leave other threads' forwards alone. (Thread A's first decoder forward is held until B has finished.)"""
    from helpers.threads import run_while_held

    target = SEQ2SEQ_FAMILIES[family]()
    draft = seq2seq_drafts_for(family, target)["perturbed"]
    pad = target.config.pad_token_id
    ids_a, mask_a = source_batch([7, 5], seed=1, pad=pad)
    ids_b, mask_b = source_batch([9, 4], seed=2, pad=pad)
    kwargs = dict(do_sample=False, max_new_tokens=12, eos_token_id=None)
    expected_a = target.generate(ids_a, attention_mask=mask_a, **kwargs)
    expected_b = target.generate(ids_b, attention_mask=mask_b, **kwargs)
    decoder = target.get_decoder()
    run_a = lambda: sk.generate(target, ids_a, attention_mask=mask_a, draft_model=draft, num_speculative_tokens=3,
                                cache_implementation=cache, **kwargs)
    run_b = lambda: target.generate(ids_b, attention_mask=mask_b, **kwargs)
    # (held after the position hooks ran, inside A's forward)
    out = run_while_held(decoder.block[0] if family == "t5" else decoder.layers[0], run_a, run_b)
    assert torch.equal(out["b"], expected_b)
    assert torch.equal(out["a"], expected_a)


@pytest.mark.parametrize("cache", [{}, {"cache_implementation": "static"}])
def test_a_callers_hook_on_the_position_table_is_kept(cache):
    """BART's decoder position table carries our hook for each forward (the true positions); it ran after a caller's
    own forward hook and recomputed the output from the weight, dropping the caller's change (other tokens than
    model.generate, silently). Ours now runs first."""
    from helpers.seq2seq_models import bart, perturbed

    target = bart()
    draft = perturbed(target)
    source = torch.randint(3, 97, (1, 8), generator=torch.Generator().manual_seed(2))
    handle = target.model.decoder.embed_positions.register_forward_hook(sk.per_token_hook(lambda module, args, out: out * 0.5))
    try:
        expected = target.generate(source, max_new_tokens=16, do_sample=False)
        got = sk.generate(target, source, draft_model=draft, num_speculative_tokens=4, max_new_tokens=16,
                          do_sample=False, **cache)
    finally:
        handle.remove()
    assert torch.equal(got, expected)
    assert not torch.equal(expected, target.generate(source, max_new_tokens=16, do_sample=False))  # the hook mattered


def test_the_encoder_pass_is_in_total_time(monkeypatch):
    """total_time_s (and tokens_per_second) left out the encoder pass over the source, which runs before the loop:
    3x the real rate on a 500-token source. An encoder made to take at least 0.3 s now shows in total_time_s (a lower
    bound the sleep guarantees, not a timing of the code)."""
    import time

    from helpers.seq2seq_models import t5

    target = t5()
    encoder = target.get_encoder()
    forward = encoder.forward

    def slow_forward(*args, **kwargs):
        time.sleep(0.3)
        return forward(*args, **kwargs)

    monkeypatch.setattr(encoder, "forward", slow_forward)
    stats = sk.SpeculationStats()
    source = torch.randint(3, 97, (1, 8), generator=torch.Generator().manual_seed(0))
    sk.generate(target, source, draft_model=target, num_speculative_tokens=3, max_new_tokens=4,
                speculation_stats=stats)
    assert stats.total_time_s >= 0.3


@pytest.mark.parametrize("family", ["t5", "bart"])
def test_decoder_input_ids_of_which_one_row_starts_with_the_start_token_get_none_prepended(family):
    """HF prepends decoder_start_token_id only when no row starts with it: a batch with one row that does and one
    that does not is taken as given (prepending to every row gave other tokens)."""
    target = {"t5": t5, "bart": bart}[family]()
    draft = seq2seq_drafts_for(family, target)["perturbed"]
    start = target.generation_config.decoder_start_token_id
    src = torch.randint(3, 90, (2, 6), generator=torch.Generator().manual_seed(0))
    kwargs = dict(decoder_input_ids=torch.tensor([[start, 17, 23], [31, 17, 23]]), max_new_tokens=5,
                  do_sample=False, eos_token_id=None)
    assert torch.equal(sk.generate(target, src, draft_model=draft, num_speculative_tokens=3, **kwargs),
                       target.generate(src, **kwargs))
