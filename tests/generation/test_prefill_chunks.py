"""HF's ``prefill_chunk_size``: every prefill of the prompts (target, draft model, early-exit draft, an
encoder-decoder's decoder prompt, continuous batching's admission) runs in forwards of at most N tokens
(``runners.prefill``), with model.generate's tokens; bad values are refused by name."""

import math

import pytest
import torch
from transformers import GenerationConfig

import speculative_kernels as sk
from helpers.models import hf_generate, llama
from helpers.prompts import left_padded
from helpers.seq2seq_models import bart, source_batch, t5

LENGTH = 9
CHUNKS = [1, 3, LENGTH - 1, LENGTH, LENGTH + 5]


@pytest.fixture(scope="module")
def pair():
    return llama(), llama(layers=1, seed=3)


def _prompts(batch):
    """batch 1: one prompt of LENGTH tokens; batch 3: left-padded rows of LENGTH, 4 and 6 tokens."""
    if batch == 1:
        return torch.randint(3, 97, (1, LENGTH), generator=torch.Generator().manual_seed(0)), None
    return left_padded([LENGTH, 4, 6])


def _widths(model) -> tuple[list, object]:
    """A recording pre-hook on ``model``: the width of each of its forwards (marked per-token: it only records)."""
    widths = []

    def record(module, args, kwargs):
        ids = kwargs.get("input_ids", kwargs.get("decoder_input_ids"))
        widths.append(ids.shape[1])

    return widths, model.register_forward_pre_hook(sk.per_token_hook(record), with_kwargs=True)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("chunk", CHUNKS)
def test_greedy_matches_hf_chunked_and_plain(pair, chunk, batch, cache):
    target, draft = pair
    ids, mask = _prompts(batch)
    kwargs = dict(attention_mask=mask, max_new_tokens=10, do_sample=False)
    plain = hf_generate(target, ids, **kwargs)
    assert torch.equal(hf_generate(target, ids, prefill_chunk_size=chunk, **kwargs), plain)
    got = sk.generate(target, ids, draft_model=draft, num_speculative_tokens=3, prefill_chunk_size=chunk,
                      cache_implementation=cache, **kwargs)
    assert torch.equal(got, plain)


def _masks(model) -> tuple[list, object]:
    """A recording pre-hook on ``model``: the attention_mask each of its forwards gets (marked per-token)."""
    masks = []

    def record(module, args, kwargs):
        masks.append(kwargs.get("attention_mask"))

    return masks, model.register_forward_pre_hook(sk.per_token_hook(record), with_kwargs=True)


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("chunk", [None, 4])
def test_an_unpadded_prompt_is_prefilled_without_a_square_mask(pair, chunk, batch):
    """The first prefill forward of an unpadded prompt (the target's and the draft's) gets no 4-D mask, as
    model.generate's prefill gets none: transformers makes the causal mask, or none under SDPA (its causal kernel).
    The runners' [B, 1, T, T] mask cost T * T writes and kept SDPA on its masked kernel: a 4000-token prompt took
    ~3x model.generate's time to first token. A padded batch's prefill keeps its 4-D mask (the padding); tokens are
    model.generate's either way."""
    target, draft = pair
    ids, mask = _prompts(batch)
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, prefill_chunk_size=chunk)
    plain = hf_generate(target, ids, **kwargs)
    (target_masks, target_hook), (draft_masks, draft_hook) = _masks(target), _masks(draft)
    try:
        got = sk.generate(target, ids, draft_model=draft, num_speculative_tokens=3, **kwargs)
    finally:
        target_hook.remove()
        draft_hook.remove()
    assert torch.equal(got, plain)
    for first in (target_masks[0], draft_masks[0]):
        assert (first is None) == (batch == 1), None if first is None else first.shape



@pytest.mark.parametrize("batch", [1, 3])
def test_the_targets_prompt_forward_of_one_new_token_or_a_greedy_request_gets_no_square_mask(pair, batch):
    """The other prompt path (``loop._prompt``: max_new_tokens=1, and a greedy request of a batch of separate
    requests, whose first token comes from the target's forward over the whole prompt): an unpadded prompt's
    forward gets no 4-D mask there too."""
    target, draft = pair
    ids, mask = _prompts(batch)
    plain = hf_generate(target, ids, attention_mask=mask, max_new_tokens=1, do_sample=False)
    masks, hook = _masks(target)
    try:
        got = sk.generate(target, ids, attention_mask=mask, draft_model=draft, max_new_tokens=1, do_sample=False)
        decoder = sk.SpeculativeDecoder(target, draft, num_speculative_tokens=3)
        decoder.add_request(ids[0, -5:].tolist(), max_new_tokens=4, do_sample=False)
        decoder.step()
    finally:
        hook.remove()
    assert torch.equal(got, plain)
    assert (masks[0] is None) == (batch == 1), None if masks[0] is None else masks[0].shape
    assert masks[1] is None  # (the request: one unpadded row, left-aligned on its own)

@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("chunk", [1, 3, LENGTH])
def test_sampled_prefill_path_runs_and_is_near_greedy(pair, chunk, cache):
    """Sampling prefills the target over the prompt but its last token (``_prefill_models``) before drafting:
    seeded, in chunks, at a temperature of 1e-6 it gives the greedy tokens; at temperature 1 it runs (chunking
    changes the float rounding, so it need not be bit-identical to the unchunked draw)."""
    target, draft = pair
    ids, mask = _prompts(3)
    plain = hf_generate(target, ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
    common = dict(attention_mask=mask, draft_model=draft, num_speculative_tokens=3, max_new_tokens=10, seed=0,
                  do_sample=True, prefill_chunk_size=chunk, cache_implementation=cache)
    assert torch.equal(sk.generate(target, ids, temperature=1e-6, **common), plain)
    out = sk.generate(target, ids, temperature=1.0, **common)
    assert out.shape == plain.shape and torch.equal(out[:, :LENGTH], ids)


@pytest.mark.parametrize("do_sample", [False, True])
@pytest.mark.parametrize("chunk", [1, 2, 4, LENGTH - 1, LENGTH, 100])
def test_prefill_runs_ceil_length_over_chunk_forwards(pair, chunk, do_sample):
    """The target's and the draft's prefill forwards: ceil(P / N) of at most N tokens each, P the prompt but its
    last token (which the first verification feeds; HF's chunks take all L, the last chunk giving the first
    token), counted in the statistics; then only decoding forwards (at most gamma + 1 wide)."""
    target, draft = pair
    ids, _ = _prompts(1)
    target_widths, hook = _widths(target)
    draft_widths, draft_hook = _widths(draft)
    stats = sk.SpeculationStats()
    try:
        sk.generate(target, ids, draft_model=draft, num_speculative_tokens=3, max_new_tokens=8, do_sample=do_sample,
                    seed=0, prefill_chunk_size=chunk, speculation_stats=stats)
    finally:
        hook.remove()
        draft_hook.remove()

    def chunks(width):
        return [min(chunk, width - start) for start in range(0, width, chunk)]

    target_prompt = LENGTH - 1
    expected = chunks(target_prompt)
    assert target_widths[: len(expected)] == expected, target_widths
    assert len(expected) == math.ceil(target_prompt / chunk)
    assert all(w <= 4 for w in target_widths[len(expected):]), target_widths
    draft_prompt = chunks(LENGTH - 1)
    assert draft_widths[: len(draft_prompt)] == draft_prompt, draft_widths
    assert all(w <= 2 for w in draft_widths[len(draft_prompt):]), draft_widths
    # every target forward is a prefill or a token-producing one
    assert stats.prefill_forwards + stats.target_forwards == len(target_widths)
    assert stats.prefill_forwards == len(expected)


def test_from_the_checkpoints_generation_config_and_overridden_by_the_call(pair):
    target, draft = pair
    ids, _ = _prompts(1)
    expected = hf_generate(target, ids, max_new_tokens=6, do_sample=False)
    target.generation_config.prefill_chunk_size = 2
    widths, hook = _widths(target)
    try:
        assert torch.equal(sk.generate(target, ids, draft_model=draft, max_new_tokens=6, do_sample=False), expected)
        assert widths[:4] == [2, 2, 2, 2] and widths[4] > 1  # (the prompt but its last token, then verification)
        widths.clear()
        out = sk.generate(target, ids, draft_model=draft, max_new_tokens=6, do_sample=False, prefill_chunk_size=None)
        assert torch.equal(out, expected) and widths[0] == LENGTH - 1
        widths.clear()
        config = GenerationConfig(max_new_tokens=6, do_sample=False, prefill_chunk_size=4)
        assert torch.equal(sk.generate(target, ids, draft_model=draft, generation_config=config), expected)
        assert widths[:2] == [4, 4] and widths[2] > 1
    finally:
        hook.remove()
        target.generation_config.prefill_chunk_size = None


@pytest.mark.parametrize("value, error", [(0, ValueError), (-1, ValueError), (True, TypeError), (False, TypeError),
                                          (2.5, TypeError), ("3", TypeError), (3.0, TypeError)])
def test_bad_values_are_refused_by_name(pair, value, error):
    """HF's validate checks nothing; torch.split fails inside its prefill (0, -1: RuntimeError; True, 2.5, "3":
    TypeError). Refused here by name, before anything runs, also from a checkpoint's generation_config."""
    target, draft = pair
    ids, _ = _prompts(1)
    with pytest.raises(error, match="prefill_chunk_size must be an int >= 1"):
        sk.generate(target, ids, draft_model=draft, max_new_tokens=4, prefill_chunk_size=value)
    target.generation_config.prefill_chunk_size = value
    try:
        with pytest.raises(error, match="prefill_chunk_size must be an int >= 1.*model's generation_config"):
            sk.generate(target, ids, draft_model=draft, max_new_tokens=4)
    finally:
        target.generation_config.prefill_chunk_size = None


def test_numpy_and_tensor_ints_are_taken(pair):
    np = pytest.importorskip("numpy")
    target, draft = pair
    ids, _ = _prompts(1)
    expected = hf_generate(target, ids, max_new_tokens=5, do_sample=False)
    for value in (np.int64(2), torch.tensor(2)):
        widths, hook = _widths(target)
        try:
            got = sk.generate(target, ids, draft_model=draft, max_new_tokens=5, do_sample=False,
                              prefill_chunk_size=value)
        finally:
            hook.remove()
        assert torch.equal(got, expected) and widths[0] == 2


def test_multimodal_inputs_stay_refused(pair):
    """HF refuses raw multimodal inputs split over several chunks; here they are refused with any chunking (this
    package generates from text only), by name, not with prefill_chunk_size's old refusal."""
    target, draft = pair
    ids, _ = _prompts(1)
    with pytest.raises(ValueError, match="pixel_values"):
        sk.generate(target, ids, draft_model=draft, max_new_tokens=4, prefill_chunk_size=2,
                    pixel_values=torch.zeros(1, 3, 8, 8))


@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_prompt_lookup_and_early_exit(pair, chunk):
    target, _ = pair
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]])
    expected = hf_generate(target, ids, max_new_tokens=8, do_sample=False)
    got = sk.generate(target, ids, prompt_lookup_num_tokens=3, max_new_tokens=8, do_sample=False,
                      prefill_chunk_size=chunk)
    assert torch.equal(got, expected)
    widths, hook = _widths(target)
    try:
        got = sk.generate(target, ids, assistant_early_exit=1, num_speculative_tokens=3, max_new_tokens=8,
                          do_sample=False, prefill_chunk_size=chunk)
    finally:
        hook.remove()
    assert torch.equal(got, expected)
    # the early-exit draft is the target's first layer: its prefill forwards go through the target too
    assert max(widths) <= max(chunk, 4), widths


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("make", [t5, bart], ids=["t5", "bart"])
@pytest.mark.parametrize("chunk", [1, 2, 3, 10])
def test_encoder_decoder_chunks_the_decoder_prompt(make, chunk, cache):
    """HF chunks the decoder prompt (decoder_input_ids), but its chunked prefill (5.24) slices the encoder's
    attention_mask to the decoder chunk's end: a size mismatch inside the model (RuntimeError) unless the source is
    no longer than the decoder prompt. The tokens here are plain model.generate's, what the chunks compute. A padded
    decoder prompt keeps its pads' positions in every chunk (they are not taken as fillers)."""
    target, draft = make(), make(layers=1, seed=5)
    ids, mask = source_batch([7, 5], pad=target.config.pad_token_id)
    start = target.config.decoder_start_token_id
    decoder_ids = torch.tensor([[start, 5, 6, 7, 8, 9], [start, 1, 10, 11, 12, 13]])
    decoder_mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 1, 1]])
    kwargs = dict(attention_mask=mask, decoder_input_ids=decoder_ids, decoder_attention_mask=decoder_mask,
                  max_new_tokens=8, do_sample=False)
    plain = hf_generate(target, ids, **kwargs)
    widths, hook = _widths(target.get_decoder())
    try:
        got = sk.generate(target, ids, draft_model=draft, num_speculative_tokens=3, prefill_chunk_size=chunk,
                          cache_implementation=cache, **kwargs)
    finally:
        hook.remove()
    assert torch.equal(got, plain)
    prompt = [min(chunk, 5 - s) for s in range(0, 5, chunk)]  # (the prompt but its last token)
    assert widths[: len(prompt)] == prompt, widths


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_session_start_and_continuous_batching(pair, cache):
    target, draft = pair
    ids, mask = _prompts(3)
    expected = hf_generate(target, ids, attention_mask=mask, max_new_tokens=7, do_sample=False)
    static = dict(cache_implementation="static", max_context=48) if cache == "static" else {}
    decoder = sk.SpeculativeDecoder(target, draft, num_speculative_tokens=3, **static)
    widths, hook = _widths(target)
    try:
        session = decoder.start(ids, attention_mask=mask, max_new_tokens=7, do_sample=False, prefill_chunk_size=4)
        while not session.finished:
            session.step()
        assert torch.equal(session.sequences(), expected)
        assert widths[:2] == [4, 4] and widths[2] > 1, widths
        # requests: a long one first, two more join while it runs
        widths.clear()
        long_prompt = list(range(3, 3 + 23))
        first = decoder.add_request(long_prompt, max_new_tokens=9, do_sample=False, prefill_chunk_size=5)
        decoder.step()
        assert widths[:5] == [5, 5, 5, 5, 3], widths
        others = [decoder.add_request([7, 8, 9, 10, 11, 12, 13], max_new_tokens=6, do_sample=False,
                                      prefill_chunk_size=3),
                  decoder.add_request([20, 21, 22, 23], max_new_tokens=6, do_sample=True, temperature=1e-6,
                                      seed=1, prefill_chunk_size=2)]
        widths.clear()
        decoder.step()  # their admission: prefilled together, in chunks of the smallest (2); one is sampled, so
        assert widths[:4] == [2, 2, 2, 4], widths  # the prompts but their last token, then a verification
        while decoder.has_work():
            decoder.step()
    finally:
        hook.remove()
    for request_id, prompt, new in ((first, long_prompt, 9), (others[0], [7, 8, 9, 10, 11, 12, 13], 6),
                                    (others[1], [20, 21, 22, 23], 6)):
        alone = hf_generate(target, torch.tensor([prompt]), max_new_tokens=new, do_sample=False)
        assert decoder.result(request_id).token_ids == alone[0, len(prompt):].tolist()
    with pytest.raises(ValueError, match="prefill_chunk_size"):
        decoder.add_request([5, 6], prefill_chunk_size=0)


def test_static_memory_check_counts_a_chunks_masks(pair, monkeypatch):
    """The static path's free-memory check counts the prefill's transient masks [B, 1, P, C]: with chunks they are
    a chunk's, so a long prompt that fits only chunked is not refused."""
    from speculative_kernels.generation.runners import factory

    target, draft = pair
    ids = torch.randint(3, 97, (1, 200), generator=torch.Generator().manual_seed(0))
    seen = []
    check = factory.check_free_memory

    def record(required, *args, **kwargs):
        seen.append(required["attention_mask"])
        return check(required, *args, **kwargs)

    monkeypatch.setattr(factory, "check_free_memory", record)
    for chunk in (None, 10):
        sk.generate(target, ids, draft_model=draft, num_speculative_tokens=3, max_new_tokens=2, do_sample=False,
                    cache_implementation="static", prefill_chunk_size=chunk)
    assert seen[1] * 20 == seen[0]



def test_a_static_unpadded_prefill_caches_no_causal_block_of_the_prompts_width(pair, monkeypatch):
    """On the static cache an unpadded prompt's forward (no 4-D mask, ``real`` None) builds its mask from slot_mask,
    as a padded one's: the additive causal blocks cached for the draft and verification widths (kept for the call,
    [T, T] each) are never made for the prompt's width, which the free-memory check does not count (a 4000-token
    prompt's would be 4000 x 4000 floats). Tokens are model.generate's."""
    from speculative_kernels.generation.runners.slot_mask import SlotMaskRunner

    target, draft = pair
    ids = torch.randint(3, 97, (1, 40), generator=torch.Generator().manual_seed(1))
    widths = []
    additive_mask = SlotMaskRunner._additive_mask

    def record(self, start, end):
        widths.append(end - start)
        return additive_mask(self, start, end)

    monkeypatch.setattr(SlotMaskRunner, "_additive_mask", record)
    got = sk.generate(target, ids, draft_model=draft, num_speculative_tokens=3, max_new_tokens=6, do_sample=False,
                      cache_implementation="static")
    assert torch.equal(got, hf_generate(target, ids, max_new_tokens=6, do_sample=False))
    assert widths and max(widths) <= 4, widths

def test_compiled_steps_after_a_chunked_prefill(pair):
    """compile=True (dynamo's aot_eager backend on the CPU: cheap to build): the prefill chunks run eagerly before
    the steps are captured, including chunk widths equal to the captured draft widths (1, 2)."""
    from speculative_kernels import CompileOptions

    target, draft = pair
    ids, mask = _prompts(3)
    plain = hf_generate(target, ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
    for chunk in (1, 2, 4):
        stats = sk.SpeculationStats()
        got = sk.generate(target, ids, attention_mask=mask, draft_model=draft, num_speculative_tokens=3,
                          max_new_tokens=10, do_sample=False, prefill_chunk_size=chunk,
                          compile=CompileOptions(backend="aot_eager"), speculation_stats=stats)
        assert torch.equal(got, plain)
        assert stats.prefill_forwards == math.ceil((LENGTH - 1) / chunk)


def test_one_new_token_comes_from_the_last_chunk(pair):
    """max_new_tokens=1: nothing is drafted and the target runs over the whole prompt, as model.generate does: in
    chunks, the last one's logits giving the token (the draft is never prefilled)."""
    target, draft = pair
    ids, mask = _prompts(3)
    expected = hf_generate(target, ids, attention_mask=mask, max_new_tokens=1, do_sample=False)
    widths, hook = _widths(target)
    draft_widths, draft_hook = _widths(draft)
    stats = sk.SpeculationStats()
    try:
        got = sk.generate(target, ids, attention_mask=mask, draft_model=draft, max_new_tokens=1, do_sample=False,
                          prefill_chunk_size=4, speculation_stats=stats)
    finally:
        hook.remove()
        draft_hook.remove()
    assert torch.equal(got, expected)
    assert widths == [4, 4, 1] and draft_widths == []
    assert (stats.prefill_forwards, stats.target_forwards) == (2, 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mode", ["dynamic", "static", "compiled"])
def test_chunked_prefill_on_cuda_matches_hf(mode):
    """On the GPU: a left-padded batch prefilled in chunks of 3, greedy, float32, on each path (the compiled one
    captures its steps after the chunked prefill), token-identical to model.generate with and without chunks."""
    target, draft = llama().cuda(), llama(layers=1, seed=3).cuda()
    ids, mask = left_padded([LENGTH, 4, 6])
    ids, mask = ids.cuda(), mask.cuda()
    kwargs = dict(attention_mask=mask, max_new_tokens=12, do_sample=False)
    plain = hf_generate(target, ids, **kwargs)
    assert torch.equal(hf_generate(target, ids, prefill_chunk_size=3, **kwargs), plain)
    options = dict(compile=True, cache_implementation="static") if mode == "compiled" else dict(
        cache_implementation=mode)
    got = sk.generate(target, ids, draft_model=draft, num_speculative_tokens=3, prefill_chunk_size=3, **options,
                      **kwargs)
    assert torch.equal(got, plain)
