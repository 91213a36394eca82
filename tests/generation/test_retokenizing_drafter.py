"""A draft model with another tokenizer (universal assisted generation, ``retokenizing_drafter.py``): greedy output
token-identical to ``model.generate`` plain and to HF's own UAD, batches with left padding, drafts accepted, sampled
continuations distributed as the target's, the host reads per iteration, and what it refuses by name. Tokenizers are
built locally (``helpers.tiny_tokenizers``)."""

import numpy as np
import pytest
import torch

import speculative_kernels as sk
from helpers.host_reads import count_reads_per_loop_step
from helpers.models import hf_generate, llama
from helpers.sampling import NEW, continuation_probs, hf_warpers, peaky
from helpers.stats import assert_matches
from helpers.tiny_tokenizers import byte_bpe, char_tokenizer, permutation, permuted, permuted_model, sentencepiece_like

CHARS = "abcdefghij klmnop"


@pytest.fixture(scope="module")
def bpe_pair():
    """A byte-level BPE target (300 ids) and a random draft on a byte tokenizer without merges (259 ids)."""
    target_tok, draft_tok = byte_bpe(300), byte_bpe(259)
    return llama(vocab=len(target_tok)), llama(layers=1, vocab=len(draft_tok), seed=4), target_tok, draft_tok


@pytest.fixture(scope="module")
def self_pair():
    """A character target, and the target itself as the draft under a permuted vocabulary with two more ids (the
    draft computes the target's distribution on its own ids)."""
    target_tok = char_tokenizer(CHARS)
    perm = permutation(len(CHARS), seed=3)
    target = llama(vocab=len(CHARS))
    target.generation_config.eos_token_id = None
    return target, permuted_model(target, perm, extra=2), target_tok, permuted(target_tok, perm, extra=("X", "Y"))


def test_the_permuted_drafts_extra_ids_score_just_below_its_id_0(self_pair):
    """``permuted_model``'s extra ids never win a greedy argmax over perm[0] (whose head row they share): their logits
    are the next float below its, in a one-token forward (a matrix-vector product, which rounds identical rows
    differently) and a longer one."""
    target, draft, target_tok, draft_tok = self_pair
    first, width = draft_tok.convert_tokens_to_ids(target_tok.convert_ids_to_tokens(0)), len(CHARS)
    for ids in (torch.tensor([[5]]), torch.arange(1, 17).view(2, 8)):
        with torch.no_grad():
            logits = draft(ids).logits
        below = torch.nextafter(logits[..., first:first + 1], torch.tensor(float("-inf")))
        assert torch.equal(logits[..., width:], below.expand(*logits.shape[:-1], 2))
        assert (logits.argmax(-1) < width).all()


def _left_padded(tokenizer, texts):
    rows = [tokenizer(t)["input_ids"] for t in texts]
    width = max(len(r) for r in rows)
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


def test_greedy_matches_model_generate_and_hfs_universal_assisted_generation(bpe_pair):
    target, draft, target_tok, draft_tok = bpe_pair
    ids = target_tok("the cat sat on", return_tensors="pt").input_ids
    expected = target.generate(ids, max_new_tokens=16, do_sample=False)
    hf_uad = hf_generate(target, ids, assistant_model=draft, tokenizer=target_tok, assistant_tokenizer=draft_tok,
                         max_new_tokens=16, do_sample=False)
    assert torch.equal(hf_uad, expected)
    for lookbehind in ({}, dict(target_lookbehind=0, assistant_lookbehind=1)):
        stats = sk.SpeculationStats()
        got = sk.generate(target, ids, assistant_model=draft, tokenizer=target_tok, assistant_tokenizer=draft_tok,
                          max_new_tokens=16, do_sample=False, speculation_stats=stats, **lookbehind)
        assert torch.equal(got, expected)
        assert stats.drafted_tokens > 0 and stats.draft_forwards > 0


def test_the_target_as_its_own_draft_under_another_vocabulary_has_every_draft_accepted(self_pair):
    """The draft sees its own tokens of the target's text: with the target's weights on permuted ids, every draft is
    the target's own choice, at batch 1 and in a left-padded batch (its cache holds holes, rows drop what they fed
    past a mismatch)."""
    target, draft, target_tok, draft_tok = self_pair
    for texts in (["abc de"], ["abc de", "fg", "hij kl mno"]):
        ids, mask = _left_padded(target_tok, texts)
        expected = target.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
        stats = sk.SpeculationStats()
        got = sk.generate(target, ids, attention_mask=mask, assistant_model=draft, tokenizer=target_tok,
                          assistant_tokenizer=draft_tok, max_new_tokens=12, do_sample=False, pad_token_id=0,
                          num_speculative_tokens=4, speculation_stats=stats)
        assert torch.equal(got, expected)
        assert stats.accepted_tokens == stats.drafted_tokens > 0
        # sampling (HF's USD: q over the shared tokens, p itself here): every draft accepted too
        sampled = sk.SpeculationStats()
        sk.generate(target, ids, attention_mask=mask, assistant_model=draft, tokenizer=target_tok,
                    assistant_tokenizer=draft_tok, max_new_tokens=12, do_sample=True, pad_token_id=0, seed=3,
                    num_speculative_tokens=4, speculation_stats=sampled)
        assert sampled.accepted_tokens == sampled.drafted_tokens > 0


def test_a_sentencepiece_style_target_with_a_byte_level_draft_matches_model_generate():
    """A Llama-2-like tokenizer for the target, a byte-level BPE for the draft (another space sign, other merges),
    a left-padded batch of 2: greedy token-identical to model.generate, and a sampled call runs."""
    target_tok, draft_tok = sentencepiece_like(400), byte_bpe(300)
    target, draft = llama(vocab=len(target_tok)), llama(layers=1, vocab=len(draft_tok), seed=4)
    ids, mask = _left_padded(target_tok, ["the cat sat", "a quick brown fox"])
    kwargs = dict(attention_mask=mask, max_new_tokens=10, pad_token_id=0)
    expected = target.generate(ids, do_sample=False, **kwargs)
    for do_sample in (False, True):
        got = sk.generate(target, ids, assistant_model=draft, tokenizer=target_tok, assistant_tokenizer=draft_tok,
                          do_sample=do_sample, num_speculative_tokens=3, seed=0, **kwargs)
        assert torch.equal(got, expected) or do_sample


def test_rejections_roll_the_drafts_cache_back_as_a_shared_vocabulary_would(self_pair):
    """With a repetition penalty on the target alone, drafts of the target's own weights are rejected now and then
    and the draft's cache rolls back (rows by different counts, around the holes of the left padding). On the
    character tokenizer the draft's tokens are the target's own, so every iteration must propose and accept
    exactly what the same weights as an ordinary draft model (one vocabulary) do."""
    target, draft, target_tok, draft_tok = self_pair
    ids, mask = _left_padded(target_tok, ["abc de", "fg", "hij kl mno"])
    kwargs = dict(attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0, repetition_penalty=2.0,
                  num_speculative_tokens=4)
    expected = target.generate(ids, **{k: v for k, v in kwargs.items() if k != "num_speculative_tokens"})
    shared, retokenized = sk.SpeculationStats(), sk.SpeculationStats()
    assert torch.equal(sk.generate(target, ids, draft_model=target, speculation_stats=shared, **kwargs), expected)
    got = sk.generate(target, ids, assistant_model=draft, tokenizer=target_tok, assistant_tokenizer=draft_tok,
                      speculation_stats=retokenized, **kwargs)
    assert torch.equal(got, expected)
    assert 0 < shared.accepted_tokens < shared.drafted_tokens
    assert (retokenized.accepted_histogram, retokenized.drafted_tokens) == (shared.accepted_histogram,
                                                                             shared.drafted_tokens)


def test_left_padded_batch_with_rows_finishing_early_matches_model_generate(bpe_pair, self_pair):
    """Batch 3, left-padded, one row ending at an EOS early (it leaves the batch: the drafter keeps the others'
    rows), the random draft and the target's own weights under another vocabulary."""
    for target, draft, target_tok, draft_tok in (bpe_pair, self_pair):
        ids, mask = _left_padded(target_tok, ["the cat sat", "a dog", "fib(n - 1) + the"] if len(target_tok) > 100
                                 else ["abc de", "fg", "hij kl mno"])
        plain = target.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0,
                                eos_token_id=None)
        eos = int(plain[1, ids.shape[1] + 2])  # row 1's third new token ends it
        expected = target.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0,
                                   eos_token_id=eos)
        stats = sk.SpeculationStats()
        got = sk.generate(target, ids, attention_mask=mask, assistant_model=draft, tokenizer=target_tok,
                          assistant_tokenizer=draft_tok, max_new_tokens=10, do_sample=False, pad_token_id=0,
                          eos_token_id=eos, num_speculative_tokens=3, speculation_stats=stats)
        assert torch.equal(got, expected)
        assert stats.dropped_rows >= 1


@pytest.mark.parametrize("drafter", ["shared tokens' q", "text, one-hot q"])
def test_sampled_continuations_follow_the_targets_distribution(drafter, monkeypatch):
    """A sharp 6-token target sampled at T = 1.3 with the target itself as its draft under another vocabulary:
    whole continuations of NEW tokens follow the target's distribution (chi-square). generate's choice when sampling,
    ``MappedVocabularyDrafter`` (HF's USD: q is the draft's distribution over the shared tokens, here p itself),
    has every draft accepted; the greedy ``RetokenizingDrafter`` (greedy drafts through the text, one-hot q: exact
    too, module docstring) has most."""
    from speculative_kernels.generation import request
    from speculative_kernels.generation.retokenizing_drafter import RetokenizingDrafter

    if drafter != "shared tokens' q":
        monkeypatch.setattr(request, "MappedVocabularyDrafter", lambda runner, pair, vocabulary, width, dtype,
                            device, **kwargs: RetokenizingDrafter(runner, pair, device, **kwargs))
    chars = "abcdef"
    target_tok = char_tokenizer(chars)
    perm = permutation(len(chars), seed=5)
    target = peaky(0, 2)
    draft, draft_tok = permuted_model(target, perm, extra=1), permuted(target_tok, perm, extra=("z",))
    prompt = torch.tensor([[1, 4, 3, 5]])
    _, probs = continuation_probs(target, prompt, hf_warpers(1.3, 0, 1.0))
    rows = 3000
    stats = sk.SpeculationStats()
    out = sk.generate(target, prompt.expand(rows, -1), assistant_model=draft, tokenizer=target_tok,
                      assistant_tokenizer=draft_tok, do_sample=True, temperature=1.3, top_k=0, max_new_tokens=NEW,
                      pad_token_id=0, num_speculative_tokens=2, seed=11, speculation_stats=stats)
    new = out[:, prompt.shape[1]:].numpy()
    codes = (new * len(chars) ** np.arange(NEW - 1, -1, -1)).sum(axis=1)
    assert_matches(np.bincount(codes, minlength=len(chars) ** NEW), probs)
    if drafter == "shared tokens' q":
        assert stats.accepted_tokens == stats.drafted_tokens > rows
    else:  # (a greedy draft is accepted with p(x), the largest p of a sharp target)
        assert stats.drafted_tokens > rows and stats.accepted_tokens > 0.6 * stats.drafted_tokens


@pytest.mark.parametrize("do_sample", [False, True])
def test_host_reads_per_iteration(self_pair, monkeypatch, do_sample):
    """The emitted tokens come from the loop's one read (``Drafter.emitted_read``). Greedy (text re-encoding): the
    drafter's only read of its own is its gamma draft tokens (their text makes the target tokens). Sampling (the
    shared tokens' q): none, the draft ids it fed ride along the loop's read. Nothing else reads the device."""
    target, draft, target_tok, draft_tok = self_pair
    reads = count_reads_per_loop_step(monkeypatch)
    ids, mask = _left_padded(target_tok, ["abc de", "fg"])
    sk.generate(target, ids, attention_mask=mask, assistant_model=draft, tokenizer=target_tok,
                assistant_tokenizer=draft_tok, max_new_tokens=20, do_sample=do_sample, pad_token_id=0, seed=0,
                repetition_penalty=2.0, num_speculative_tokens=3)  # (rejections: the draft's cache rolls back)
    # (an iteration that drafts nothing, one token left, has the loop's read alone)
    drafting = [r for r in reads if r != ["tolist"]]
    assert len(reads) > 3 and drafting == ([] if do_sample else [["tolist", "tolist"]] * len(drafting))
    assert do_sample or len(drafting) >= len(reads) - 1, reads


def test_vocabulary_map_writes_the_drafts_space_sign_as_the_targets():
    """A SentencePiece-style draft ("▁the") and a byte-level target ("Ġthe"): the same words map to each other, and
    a word the target lacks maps to nothing."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from speculative_kernels.generation.retokenizing_drafter import VocabularyMap

    target_tok = byte_bpe(300)
    words = ["▁the", "▁dog", "the", "zz"]
    sentencepiece = Tokenizer(models.BPE(vocab={w: i for i, w in enumerate(words)}, merges=[]))
    sentencepiece.pre_tokenizer = pre_tokenizers.Metaspace()
    sentencepiece.decoder = decoders.Metaspace()
    draft_tok = PreTrainedTokenizerFast(tokenizer_object=sentencepiece)
    vocab = target_tok.get_vocab()
    mapped = VocabularyMap(target_tok, draft_tok, 300, 4, torch.device("cpu"))
    assert mapped.to_target.tolist() == [vocab["Ġthe"], vocab["Ġdog"], vocab["the"], -1]
    assert mapped.to_draft[vocab["Ġthe"]] == 0 and mapped.size == 3


def test_rows_stop_drafting_at_the_drafts_position_table(bpe_pair):
    """A GPT-2 draft with a 24-position table on byte tokens (about 3 per target token): each row drafts while its
    draft tokens fit, then the target goes on alone for it (the draft is fed holes), greedy and sampled, at batch 2;
    a prompt whose text is longer than the table in draft tokens is refused naming draft_model. (The draft's table
    was checked against the target's token counts: 24 passed, and the draft's forward failed inside the embedding.)"""
    from transformers import GPT2Config, GPT2LMHeadModel

    target, _, target_tok, draft_tok = bpe_pair
    torch.manual_seed(4)
    draft = GPT2LMHeadModel(GPT2Config(vocab_size=len(draft_tok), n_embd=16, n_layer=1, n_head=2, n_positions=24,
                                       bos_token_id=1, eos_token_id=2, pad_token_id=0)).eval()
    ids, mask = _left_padded(target_tok, ["the cat", "a dog sat"])
    kwargs = dict(attention_mask=mask, max_new_tokens=12, pad_token_id=0, eos_token_id=None)
    expected = target.generate(ids, do_sample=False, **kwargs)
    for do_sample in (False, True):
        stats = sk.SpeculationStats()
        got = sk.generate(target, ids, assistant_model=draft, tokenizer=target_tok, assistant_tokenizer=draft_tok,
                          do_sample=do_sample, num_speculative_tokens=3, speculation_stats=stats, seed=0, **kwargs)
        assert do_sample or torch.equal(got, expected)
        assert stats.drafted_tokens > 0
    long = target_tok("the draft proposes and the target disposes", return_tensors="pt").input_ids
    with pytest.raises(ValueError, match="draft_model has a learned position table of 24 positions"):
        sk.generate(target, long, assistant_model=draft, tokenizer=target_tok, assistant_tokenizer=draft_tok,
                    max_new_tokens=4)


@pytest.mark.parametrize("compact", [False, True])
def test_draft_slots_drop_tokens_across_holes(compact):
    """DraftSlots on a real runner: rows fed tails of different lengths (left-padded with holes), then dropping more
    tokens than the last forward fed, across holes (a re-encoding that changed earlier draft tokens), with or
    without a hole compaction before a later drop: each step's logits are those of the row's kept tokens alone."""
    from speculative_kernels.generation.capabilities import check_model
    from speculative_kernels.generation.retokenizing_drafter import DraftSlots
    from speculative_kernels.generation.runners.decoder import DecoderRunner

    model = llama(layers=1, seed=4)
    runner = DecoderRunner(model, check_model(model, target=False), 2, 64, torch.device("cpu"),
                           compaction_threshold=0.0 if compact else 1.0)
    slots = DraftSlots(runner, 2, torch.device("cpu"), None)

    def step(tokens, expected):
        logits = slots.forward(tokens)[:, -1]
        with torch.no_grad():
            for row, kept in enumerate(expected):
                torch.testing.assert_close(logits[row], model(torch.tensor([kept])).logits[0, -1])

    slots.forward([[5, 6, 7], [8]], prompt=True)
    slots.forward([[9], [10, 11, 12]])
    slots.forward([[13, 14], [15]])
    slots.keep([2, 2])  # row 0 drops 7, 9, 13, 14 (across its holes), row 1 drops 11, 12, 15 (across one)
    step([[16], [17, 18]], ([5, 6, 16], [8, 10, 17, 18]))
    runner.lengths_read([len(f) for f in slots.fed])  # (the loop's read, which lets the compactor act)
    slots.keep([3, 3])
    assert runner.compactions == int(compact)
    slots.keep([2, 3])  # after the compaction: every row's real slots first
    step([[21], [22]], ([5, 6, 21], [8, 10, 17, 22]))


def test_a_split_character_waits_for_its_last_byte():
    """RowText: a character whose bytes come in two target tokens enters the text when both have (no replacement
    character), whatever the lookbehind; the draft's tokens follow the text."""
    from speculative_kernels.generation.retokenize import RowText, TokenizerPair

    target_tok, draft_tok = byte_bpe(259), byte_bpe(300)
    for lookbehind in (0, 10):
        row = RowText(TokenizerPair(target_tok, draft_tok, target_lookbehind=lookbehind), target_tok("a")["input_ids"])
        first, second = target_tok("é")["input_ids"]
        row.extend([first])
        assert row.text == "a" and row.proposal([5], 3) == []
        row.extend([second])
        assert row.text == "aé" and draft_tok.decode(row.draft_ids) == "aé"


def test_a_new_word_merging_with_the_last_draft_tokens_is_re_encoded():
    """RowText: " th" then "e" from a byte-level target; the draft's BPE writes " the" as one token, so its last
    tokens change: they are re-encoded from the lookbehind mark (the draft's tokens are then the tokenizer's own for
    the whole text), and ``take_unchanged`` reports where they changed (the draft's cache refeeds from there)."""
    from speculative_kernels.generation.retokenize import RowText, TokenizerPair, common_prefix

    target_tok, draft_tok = byte_bpe(259), byte_bpe(300)
    row = RowText(TokenizerPair(target_tok, draft_tok), target_tok("a dog")["input_ids"])
    row.take_unchanged()
    row.extend(target_tok(" th")["input_ids"])
    middle, _ = list(row.draft_ids), row.take_unchanged()
    row.extend(target_tok("e")["input_ids"])
    assert row.draft_ids == draft_tok("a dog the")["input_ids"] and row.text == "a dog the"
    changed = row.take_unchanged()
    assert changed == common_prefix(middle, row.draft_ids) < len(middle)


@pytest.mark.parametrize("lookbehind", [0, 2])
@pytest.mark.parametrize("target_kind", ["byte-level", "sentencepiece"])
def test_text_stays_the_same_through_either_kind_of_tokenizer(target_kind, lookbehind):
    """A byte-level BPE (GPT-2's "Ġ") and a SentencePiece-style one (Llama 2's: "▁" prepended by its normalizer, the
    first space stripped by its decoder), either as the target: fed a sentence's target tokens a few at a time, the
    draft's tokens spell the row's text exactly (no word-initial space of its own at each re-encoded window), and
    the draft tokens of a continuation become target tokens that spell it. Lookbehinds of 0 too: the new tokens are
    still decoded after some earlier text (decoded alone, SentencePiece's decoder stripped each window's first
    space: "the draftproposesand...")."""
    from speculative_kernels.generation.retokenize import RowText, TokenizerPair

    tokenizers = byte_bpe(300), sentencepiece_like(400)
    target_tok, draft_tok = tokenizers if target_kind == "byte-level" else tokenizers[::-1]
    pair = TokenizerPair(target_tok, draft_tok, target_lookbehind=lookbehind, assistant_lookbehind=lookbehind)
    text = "the draft proposes and the target disposes the lazy dog"
    ids = target_tok(text, add_special_tokens=False)["input_ids"]
    row = RowText(pair, ids[:2])
    for k in range(2, len(ids), 3):
        row.extend(ids[k : k + 3])
        assert pair.decode_target(row.target_ids) == row.text
        assert draft_tok.decode(row.draft_ids, skip_special_tokens=True) == row.text
    assert row.text == text
    continuation = " sat on the mat"
    drafts = draft_tok(text + continuation, add_special_tokens=False)["input_ids"][len(row.draft_ids):]
    assert draft_tok.decode(row.draft_ids + drafts, skip_special_tokens=True) == text + continuation
    proposal = row.proposal(drafts, 64)
    assert proposal and pair.decode_target(row.target_ids + proposal) == text + continuation


def test_proposals_hold_only_ids_the_target_can_emit(self_pair):
    """A draft EOS is proposed as the first of the target's EOS ids that its head has (an eos_token_id list may
    name ids past it, as model.generate takes them), and a draft's text up to the first token that the target's
    tokenizer has past the target's head (a tokenizer with more ids than the model). Before, such ids were
    proposed and the call failed on the drafter's ids outside the target's vocabulary."""
    import copy

    target, draft, target_tok, draft_tok = self_pair
    ids = target_tok("abc de", return_tensors="pt").input_ids
    kwargs = dict(max_new_tokens=8, do_sample=False)
    ending = copy.deepcopy(draft)  # (the draft's EOS: the text's "j", which the target says from its second token)
    ending.generation_config.eos_token_id = draft_tok.convert_tokens_to_ids("j")
    expected = target.generate(ids, eos_token_id=[len(CHARS) + 3, 16], **kwargs)
    got = sk.generate(target, ids, assistant_model=ending, tokenizer=target_tok, assistant_tokenizer=draft_tok,
                      eos_token_id=[len(CHARS) + 3, 16], num_speculative_tokens=3, **kwargs)
    assert torch.equal(got, expected)
    wide_tok = char_tokenizer(CHARS + "q")  # ("q": an id past the target's head)
    says_q = copy.deepcopy(draft)
    with torch.no_grad():  # (the draft's "X" says "q" and wins: its head row is 3 times the row of "j")
        head = says_q.get_output_embeddings().weight
        head[draft_tok.convert_tokens_to_ids("X")] = 3 * head[draft_tok.convert_tokens_to_ids("j")]
    q_tok = permuted(target_tok, permutation(len(CHARS), seed=3), extra=("q", "Y"))
    stats = sk.SpeculationStats()
    got = sk.generate(target, ids, assistant_model=says_q, tokenizer=wide_tok, assistant_tokenizer=q_tok,
                      eos_token_id=None, num_speculative_tokens=3, speculation_stats=stats, **kwargs)
    assert torch.equal(got, target.generate(ids, eos_token_id=None, **kwargs))
    assert stats.draft_forwards > 0


@pytest.mark.parametrize("setting,words", [
    (dict(cache_implementation="static"), "cache_implementation='static'"),
    (dict(compile=True), "compile=True"),
    (dict(target_lookbehind=-1), "target_lookbehind must be an int >= 0"),
    (dict(assistant_lookbehind=2.5), "assistant_lookbehind must be an int >= 0"),
])
def test_what_it_cannot_do_is_refused_by_name(self_pair, setting, words):
    target, draft, target_tok, draft_tok = self_pair
    ids = target_tok("abc", return_tensors="pt").input_ids
    with pytest.raises(ValueError, match=words):
        sk.generate(target, ids, assistant_model=draft, tokenizer=target_tok, assistant_tokenizer=draft_tok,
                    max_new_tokens=4, num_speculative_tokens=2, **setting)


def test_requests_joining_a_running_batch_match_each_request_alone(bpe_pair):
    """SpeculativeDecoder.add_request with a draft of another tokenizer: requests joining at different steps (the
    drafter's add_rows; rows leaving as they finish), each greedy request token-identical to model.generate alone;
    a sampled one beside them runs to its length (the text drafter's one-hot q, exact for sampled rows too)."""
    from helpers.continuous import alone, run_arrivals

    target, draft, target_tok, draft_tok = bpe_pair
    decoder = sk.SpeculativeDecoder(target, draft, tokenizer=target_tok, assistant_tokenizer=draft_tok,
                                    num_speculative_tokens=3)
    prompts = [target_tok(t)["input_ids"] for t in ("the cat sat", "a quick brown fox jumps", "def fib(n):")]
    sampled = dict(max_new_tokens=7, do_sample=True, seed=5, eos_token_id=None)
    arrivals = {0: [(prompts[0], dict(max_new_tokens=9))],
                2: [(prompts[1], dict(max_new_tokens=6)), (prompts[2], dict(max_new_tokens=8)), (prompts[0], sampled)]}
    requests, streamed = run_arrivals(decoder, arrivals)
    for request_id, (prompt, settings) in requests.items():
        if settings is sampled:
            assert len(streamed[request_id]) == 7
        else:
            assert streamed[request_id] == alone(target, None, prompt, settings, 3, "cpu")


def test_joined_rows_roll_back_as_a_shared_vocabulary_draft_would(self_pair):
    """Requests joining a running batch, with a repetition penalty (rejections: every row's draft cache rolls back
    around the holes the join left): per request, the target's own weights under the permuted vocabulary draft and
    keep exactly what they do as an ordinary draft model on the shared vocabulary."""
    from helpers.continuous import run_arrivals

    target, draft, target_tok, draft_tok = self_pair
    settings = dict(max_new_tokens=16, repetition_penalty=2.0)
    prompts = [target_tok(t)["input_ids"] for t in ("abc de", "fg", "hij kl mno")]
    arrivals = {0: [(prompts[0], settings)], 2: [(prompts[1], settings)], 3: [(prompts[2], settings)]}
    counts = []
    for decoder in (sk.SpeculativeDecoder(target, target, num_speculative_tokens=4),
                    sk.SpeculativeDecoder(target, draft, tokenizer=target_tok, assistant_tokenizer=draft_tok,
                                          num_speculative_tokens=4)):
        requests, streamed = run_arrivals(decoder, arrivals)
        results = [decoder.result(request_id) for request_id in sorted(requests)]
        counts.append([(r.token_ids, r.drafted_tokens, r.accepted_tokens) for r in results])
    assert counts[0] == counts[1]
    assert 0 < sum(c[2] for c in counts[0]) < sum(c[1] for c in counts[0])


def test_batches_of_requests_and_encoder_decoders_are_refused_by_name(self_pair):
    from helpers.seq2seq_models import t5

    target, draft, target_tok, draft_tok = self_pair
    for setting, words in ((dict(cache_implementation="static"), "cache_implementation='static'"),
                           (dict(compile=True), "compile")):
        with pytest.raises(ValueError, match=words):
            sk.SpeculativeDecoder(target, draft, tokenizer=target_tok, assistant_tokenizer=draft_tok, **setting)
    seq2seq = t5(vocab=len(CHARS))
    with pytest.raises(ValueError, match="decoder-only"):
        sk.generate(seq2seq, target_tok("abc", return_tensors="pt").input_ids, assistant_model=t5(vocab=19, seed=2),
                    tokenizer=target_tok, assistant_tokenizer=draft_tok, max_new_tokens=4)


def test_a_proposal_cut_at_an_id_past_the_targets_head_ends_without_the_eos():
    """RowText.proposal: drafts ending in the draft's EOS are proposed with the target's EOS after their text, but
    drafts whose text reaches an id past the target's head are proposed up to it only (the text after it, "h", and
    the EOS after that text were never said first). Mutation hunt: the EOS appended after the cut proposal passed
    every other test."""
    from speculative_kernels.generation.retokenize import RowText, TokenizerPair

    tok = char_tokenizer(CHARS + "qZ")  # "q": past the target's head (V = len(CHARS)); "Z": the draft's EOS

    def ids(text):
        return tok(text, add_special_tokens=False)["input_ids"]

    eos, target_eos = ids("Z")[0], ids("p")[0]
    pair = TokenizerPair(tok, tok, target_lookbehind=2, assistant_lookbehind=2, draft_eos=frozenset({eos}),
                         target_eos=target_eos, target_width=len(CHARS))
    row = RowText(pair, ids("abc de"))
    assert row.proposal(ids("fg") + [eos], 8) == ids("fg") + [target_eos]
    assert row.proposal(ids("fgqh") + [eos], 8) == ids("fg")
    assert row.proposal(ids("q") + [eos], 8) == []


def test_draft_tokens_past_the_drafts_embedding_are_fed_as_id_0():
    """An assistant_tokenizer with more ids than the draft model embeds ("c", "b", "a" here: ids 14-16 of a 14-id
    embedding), in the prompt's text and drafted by a head wider than the embedding (17 ids, those 3 favoured): the
    draft is fed id 0 for them, as a shared-vocabulary draft is fed the target tokens it cannot embed (``vocab.py``):
    greedy token-identical to model.generate, and a sampled batch runs to its length. Before, the draft's forward
    failed inside the embedding (IndexError; HF's UAD and USD fail there too)."""
    target_tok, draft_tok = char_tokenizer(CHARS), char_tokenizer(CHARS[::-1])
    target, draft = llama(vocab=len(CHARS)), llama(layers=1, vocab=len(CHARS) - 3, seed=4)
    draft.config.tie_word_embeddings = False
    draft.lm_head = torch.nn.Linear(32, len(CHARS), bias=False)
    with torch.no_grad():
        draft.lm_head.weight[len(CHARS) - 3:] *= 5
    ids, mask = _left_padded(target_tok, ["abc de", "ba"])
    kwargs = dict(attention_mask=mask, max_new_tokens=8, pad_token_id=0, eos_token_id=None)
    expected = target.generate(ids, do_sample=False, **kwargs)
    for do_sample in (False, True):
        stats = sk.SpeculationStats()
        got = sk.generate(target, ids, assistant_model=draft, tokenizer=target_tok, assistant_tokenizer=draft_tok,
                          do_sample=do_sample, num_speculative_tokens=3, seed=0, speculation_stats=stats, **kwargs)
        assert torch.equal(got, expected) or (do_sample and got.shape == expected.shape)
        assert stats.draft_forwards > 0


def test_add_request_counts_a_position_table_drafts_own_tokens():
    """SpeculativeDecoder.add_request with a GPT-2 draft of another tokenizer (a 24-position table; byte-level BPE
    with merges, fewer tokens than the byte-level target's): the draft's table is the drafter's to count in its own
    tokens, as in generate (``test_rows_stop_drafting_at_the_drafts_position_table``), so a request of 30 target
    positions runs and matches model.generate alone. Before, add_request checked the draft's table against the
    target's tokens and refused it by name."""
    from transformers import GPT2Config, GPT2LMHeadModel

    target_tok, draft_tok = byte_bpe(259), byte_bpe(300)
    target = llama(vocab=len(target_tok), seed=3)
    torch.manual_seed(4)
    draft = GPT2LMHeadModel(GPT2Config(vocab_size=len(draft_tok), n_embd=16, n_layer=1, n_head=2, n_positions=24,
                                       bos_token_id=1, eos_token_id=2, pad_token_id=0)).eval()
    prompt = target_tok("the cat sat")["input_ids"]  # (11 target tokens, 4 draft tokens)
    settings = dict(max_new_tokens=20, eos_token_id=None)
    decoder = sk.SpeculativeDecoder(target, draft, tokenizer=target_tok, assistant_tokenizer=draft_tok,
                                    num_speculative_tokens=3)
    request_id = decoder.add_request(prompt, **settings)
    while decoder.has_work():
        decoder.step()
    result = decoder.result(request_id)
    expected = target.generate(torch.tensor([prompt]), do_sample=False, pad_token_id=0, **settings)
    assert result.token_ids == expected[0, len(prompt):].tolist()
    assert result.drafted_tokens > 0


def test_a_slot_table_draft_is_never_fed_past_its_table(bpe_pair):
    """A GPT-Neo draft (its attention slices a causal table of max_position_embeddings = 32 key slots with the
    cache's slot count) on byte tokens, in a left-padded batch: the holes of the left padding and of rejected drafts
    take slots beyond the rows' positions, so an iteration whose forwards would pass the table drafts nothing (the
    target goes on alone, exactly): token-identical to model.generate. Before, the draft's forward raised the
    runner's ValueError mid-generation (the request itself fits: its rows stop drafting at the 32 positions)."""
    from transformers import GPTNeoConfig, GPTNeoForCausalLM

    target, _, target_tok, draft_tok = bpe_pair
    torch.manual_seed(5)
    draft = GPTNeoForCausalLM(GPTNeoConfig(vocab_size=len(draft_tok), hidden_size=16, num_layers=1, num_heads=2,
                                           attention_types=[[["global"], 1]], max_position_embeddings=32,
                                           bos_token_id=1, eos_token_id=2, pad_token_id=0)).eval()
    ids, mask = _left_padded(target_tok, ["the cat sat", "a dog"])
    kwargs = dict(attention_mask=mask, max_new_tokens=16, pad_token_id=0, eos_token_id=None, do_sample=False)
    stats = sk.SpeculationStats()
    got = sk.generate(target, ids, assistant_model=draft, tokenizer=target_tok, assistant_tokenizer=draft_tok,
                      num_speculative_tokens=3, speculation_stats=stats, **kwargs)
    assert torch.equal(got, target.generate(ids, **kwargs))
    assert stats.drafted_tokens > 0
