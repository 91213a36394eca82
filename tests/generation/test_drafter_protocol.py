"""What the loop does with a ``Drafter`` of the user's that breaks its protocol (``generation/proposal.py``): a
proposal of another width than gamma, ids outside the vocabulary, counts outside 0..gamma, a token its own q gives
probability 0 are refused naming the drafter (they used to give other tokens silently, or an IndexError inside the
embedding); fillers past a row's count may hold anything; q is verified in the dtype it was drawn from."""

import pytest
import torch

import speculative_kernels as sk
from helpers.models import llama
from speculative_kernels.generation import loop as loop_module

VOCAB = 97


class Scripted:
    """A drafter proposing ``script(batch, gamma)`` -> (tokens, logits, num_draft), with no state."""

    forwards = compactions = 0

    def __init__(self, script):
        self.script = script

    def start(self, input_ids, real):
        self.batch = input_ids.shape[0]

    def propose(self, gamma, choose):
        return self.script(self.batch, gamma)

    def observe(self, out, accepted, finished):
        pass

    def accept(self, *args):
        pass

    def proposal_counts(self):
        return None

    def select_rows(self, index):
        self.batch = index.numel()

    def add_rows(self, other):
        self.batch += other.batch

    def lengths_to_read(self):
        return None

    def lengths_read(self, lengths):
        pass


def _tokens(batch, width, value=5):
    return torch.full((batch, width), value, dtype=torch.int64)


@pytest.fixture(scope="module")
def target():
    return llama()


def _ids():
    return torch.randint(3, VOCAB, (1, 8), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("script,words", [
    (lambda b, g: (_tokens(b, g + 3), None, None), r"Scripted\.propose\(4, \.\.\.\) returned tokens of shape \(1, 7\)"),
    (lambda b, g: (_tokens(b, g - 1), None, None), r"returned tokens of shape \(1, 3\).*shape \[1, 4\]"),
    (lambda b, g: (_tokens(b, g).int(), None, None), r"returned tokens .* dtype torch.int32"),
    (lambda b, g: (_tokens(b, g).tolist(), None, None), r"returned tokens of type list"),
    (lambda b, g: (_tokens(b, g), torch.zeros(b, g, VOCAB - 1), None), r"returned logits of shape \(1, 4, 96\)"),
    (lambda b, g: (_tokens(b, g), torch.zeros(b, g, VOCAB, dtype=torch.float64), None), r"returned logits .*float64"),
    (lambda b, g: (_tokens(b, g), None, torch.tensor([[2]])), r"returned num_draft of shape \(1, 1\)"),
])
def test_a_proposal_of_the_wrong_shape_or_type_is_refused_by_name(target, script, words):
    with pytest.raises((ValueError, TypeError), match=words):
        sk.generate(target, _ids(), drafter=Scripted(script), num_speculative_tokens=4, max_new_tokens=12,
                    do_sample=False)


@pytest.mark.parametrize("do_sample", [False, True])
@pytest.mark.parametrize("script,words", [
    (lambda b, g: (_tokens(b, g, 5000), None, None), r"token ids outside the target's vocabulary \[0, 97\): \[5000"),
    (lambda b, g: (_tokens(b, g, -3), None, None), r"outside the target's vocabulary \[0, 97\): \[-3"),
    (lambda b, g: (_tokens(b, g), None, torch.tensor([g + 5])), r"num_draft=9 tokens for a row; it must be in 0\.\.gamma"),
    (lambda b, g: (_tokens(b, g), None, torch.tensor([-2])), r"num_draft=-2"),
    # -1 too (the loop's own marker of an invalid row: flagged, it read "invalid input in batch rows [0]")
    (lambda b, g: (_tokens(b, g), None, torch.tensor([-1])), r"num_draft=-1"),
])
def test_invalid_proposed_values_are_refused_by_name(target, script, words, do_sample):
    with pytest.raises(ValueError, match=f"the drafter Scripted proposed .*{words}"):
        sk.generate(target, _ids(), drafter=Scripted(script), num_speculative_tokens=4, max_new_tokens=12,
                    do_sample=do_sample)


def test_a_token_its_own_q_cannot_draw_is_refused():
    """q one-hot at token A (every other logit 1e4 below: probability 0 in float32) while proposing B: sampled
    output left the target's distribution silently (the target's likeliest token was never emitted)."""
    model = llama()

    def script(batch, gamma):
        q = torch.full((batch, gamma, VOCAB), -1e4)
        q[..., 7] = 0.0
        return _tokens(batch, gamma, 8), q, None

    with pytest.raises(ValueError, match="proposed a token that its own q .* gives probability 0"):
        sk.generate(model, _ids(), drafter=Scripted(script), num_speculative_tokens=2, max_new_tokens=6,
                    do_sample=True, seed=0)
    # greedy reads no q: the same drafter is exact there
    expected = model.generate(_ids(), max_new_tokens=6, do_sample=False)
    assert torch.equal(sk.generate(model, _ids(), drafter=Scripted(script), num_speculative_tokens=2,
                                   max_new_tokens=6, do_sample=False), expected)


def test_fillers_past_a_rows_count_may_hold_any_id(target):
    """ops.verify never reads past a row's count, so -1 fillers are allowed there (clamped for the forward)."""
    def script(batch, gamma):
        tokens = _tokens(batch, gamma, -1)
        tokens[:, 0] = 5
        return tokens, None, torch.ones(batch, dtype=torch.int64)

    expected = target.generate(_ids(), max_new_tokens=12, do_sample=False)
    got = sk.generate(target, _ids(), drafter=Scripted(script), num_speculative_tokens=4, max_new_tokens=12,
                      do_sample=False)
    assert torch.equal(got, expected)


def test_a_bad_request_in_continuous_batching_fails_alone(target):
    """A request whose drafter proposes an id outside the vocabulary ends with finish_reason 'error' and the
    reason (as a request whose own logits leave no token), instead of an IndexError from the embedding."""
    def script(batch, gamma):
        tokens = _tokens(batch, gamma)
        tokens[0] = 5000
        return tokens, None, None

    decoder = sk.SpeculativeDecoder(target, drafter=lambda: Scripted(script), num_speculative_tokens=3)
    ids = torch.randint(3, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    bad = decoder.add_request(ids[0], max_new_tokens=10, do_sample=False)
    while decoder.has_work():
        decoder.step()
    result = decoder.result(bad)
    assert result.finish_reason == "error" and "outside the target's vocabulary" in result.error


def test_q_is_verified_in_the_dtype_it_was_drawn_from(monkeypatch):
    """A float32 q (the n-gram drafter's, a user's) with a bfloat16 target: the verification gets it as float32. It
    was rounded to bfloat16 first, so the acceptance test used another q than the one sampled (not exact)."""
    model = llama().to(torch.bfloat16)
    seen = []
    original = loop_module.SpeculativeLoop._verify

    def spy(self, draft_tokens, draft_logits, num_draft):
        impl_verify = self.impl.verify

        def verify(target_logits, q_logits, *args, **kwargs):
            seen.append(None if q_logits is None else q_logits.dtype)
            return impl_verify(target_logits, q_logits, *args, **kwargs)

        monkeypatch.setattr(self, "impl", type("Impl", (), {"verify": staticmethod(verify),
                                                           "sample": staticmethod(self.impl.sample)}))
        return original(self, draft_tokens, draft_logits, num_draft)

    monkeypatch.setattr(loop_module.SpeculativeLoop, "_verify", spy)
    ids = torch.randint(3, VOCAB, (1, 30), generator=torch.Generator().manual_seed(2)).repeat(1, 2)
    sk.generate(model, ids, drafter=sk.NGramDrafter.for_model(model), num_speculative_tokens=3, do_sample=True,
                max_new_tokens=8, seed=0)
    assert seen and all(dtype == torch.float32 for dtype in seen if dtype is not None)


class WithLengths(Scripted):
    """Proposes a fixed token, and asks for ``lengths()`` in the iteration's host read."""

    def __init__(self, lengths):
        super().__init__(lambda b, g: (_tokens(b, g), None, None))
        self.lengths, self.read = lengths, []

    def lengths_to_read(self):
        return self.lengths()

    def lengths_read(self, lengths):
        self.read.append(lengths)


@pytest.mark.parametrize("lengths,words", [
    (lambda: torch.zeros(1), r"shape \(1,\) and dtype torch.float32"),
    (lambda: torch.zeros(1, dtype=torch.float16), r"shape \(1,\) and dtype torch.float16"),
    (lambda: torch.zeros(1, dtype=torch.bool), r"shape \(1,\) and dtype torch.bool"),
    (lambda: torch.zeros(1, 2, dtype=torch.int64), r"shape \(1, 2\)"),
    (lambda: torch.tensor(3), r"shape \(\)"),
    (lambda: [3], r"list; it must be"),
])
def test_lengths_to_read_of_another_dtype_or_shape_is_refused_by_name(target, lengths, words):
    """They are read on the host concatenated with the iteration's token ids: a float tensor turned every id read
    into a float (float16: rounded ids, on which the EOS cut then ran: early stops), silently."""
    with pytest.raises((ValueError, TypeError), match=r"WithLengths\.lengths_to_read\(\) returned (a tensor of )?"
                                                      + words):
        sk.generate(target, _ids(), drafter=WithLengths(lengths), num_speculative_tokens=3, max_new_tokens=8,
                    do_sample=False)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])  # (int32 is promoted exactly by the read's cat)
def test_integer_lengths_to_read_are_read_with_the_tokens(target, dtype):
    drafter = WithLengths(lambda: torch.tensor([7, 9], dtype=dtype))
    expected = target.generate(_ids(), max_new_tokens=8, do_sample=False)
    got = sk.generate(target, _ids(), drafter=drafter, num_speculative_tokens=3, max_new_tokens=8, do_sample=False)
    assert torch.equal(got, expected) and drafter.read and all(r == [7, 9] for r in drafter.read)


class CountedQ(Scripted):
    """Draws through ``choose`` from a q indexed by the row's length and proposes 1 + last % 4 of its tokens (a
    function of the row's own context), counts reported on the host (``lengths_to_read`` -> ``proposal_counts``)."""

    def __init__(self):
        super().__init__(None)
        self.table = torch.randn(64, VOCAB, generator=torch.Generator().manual_seed(0)) * 2
        self.host = None

    def start(self, input_ids, real):
        self.batch = input_ids.shape[0]
        self.last, self.length = input_ids[:, -1].clone(), real.sum(1)
        self.count = 1 + self.last % 4

    def propose(self, gamma, choose):
        tokens = torch.empty(self.batch, gamma, dtype=torch.int64)
        q = torch.empty(self.batch, gamma, VOCAB)
        for i in range(gamma):
            logits = self.table[(self.length + i) % 64].clone()
            tokens[:, i] = choose(logits, i)
            q[:, i] = logits
        return tokens, q, self.count.clamp(max=gamma)

    def observe(self, out, accepted, finished):
        n = sk.emitted_counts(accepted, finished)
        self.last = torch.where(n > 0, out.gather(1, (n - 1).clamp(min=0).unsqueeze(1))[:, 0], self.last)
        self.length = self.length + n
        self.count, self.host = 1 + self.last % 4, None

    def lengths_to_read(self):
        return self.count

    def lengths_read(self, lengths):
        self.host = list(lengths)

    def proposal_counts(self):
        return self.host

    def select_rows(self, index):
        self.batch = index.numel()
        self.last, self.length, self.count = (t.index_select(0, index) for t in (self.last, self.length, self.count))
        self.host = None

    def add_rows(self, other):
        self.batch += other.batch
        self.last, self.length, self.count = (torch.cat([a, b]) for a, b in ((self.last, other.last),
                                                                             (self.length, other.length),
                                                                             (self.count, other.count)))
        self.host = None


def test_a_seeded_request_with_per_row_counts_does_not_depend_on_its_batch_mates(target):
    """A drafter drawing through choose with per-row counts: gamma is the batch's largest count, and every row's
    draft offsets advanced by it, so a seeded request's tokens changed with its batch-mates (the continuous
    batching's promise); each row now gives back the offsets of its fillers."""
    prompt = torch.randint(3, VOCAB, (6,), generator=torch.Generator().manual_seed(1))
    settings = dict(max_new_tokens=20, do_sample=True, temperature=1.0, top_k=0, eos_token_id=None)
    alone = sk.generate(target, prompt[None], drafter=CountedQ(), num_speculative_tokens=4, seed=5, **settings)
    for mates in (0, 2):
        decoder = sk.SpeculativeDecoder(target, drafter=CountedQ, num_speculative_tokens=4)
        request = decoder.add_request(prompt, seed=5, **settings)
        for i in range(mates):
            mate = torch.randint(3, VOCAB, (5,), generator=torch.Generator().manual_seed(10 + i))
            decoder.add_request(mate, seed=20 + i, **settings)
        while decoder.has_work():
            decoder.step()
        assert decoder.result(request).token_ids == alone[0, 6:].tolist(), mates


def _zero_q(batch, gamma):
    """Proposes token 8 with q one-hot at 7 (every other logit 1e4 below): probability 0 at its own token."""
    q = torch.full((batch, gamma, VOCAB), -1e4)
    q[..., 7] = 0.0
    return _tokens(batch, gamma, 8), q, None


@pytest.mark.parametrize("mate", [None, "greedy", "sampled"])
def test_greedy_requests_in_continuous_batching_do_not_check_q(target, mate):
    """A greedy request's verification reads no q, as greedy generate's (which runs with this drafter): its rows
    were checked at temperature 1 and the request failed with 'its own q gives probability 0'. A sampled request
    beside it is still refused."""
    prompt = _ids()[0]
    expected = target.generate(prompt[None], max_new_tokens=10, do_sample=False, eos_token_id=None)[0, 8:].tolist()
    decoder = sk.SpeculativeDecoder(target, drafter=lambda: Scripted(_zero_q), num_speculative_tokens=3)
    greedy = decoder.add_request(prompt, max_new_tokens=10, do_sample=False, eos_token_id=None)
    other = None
    if mate is not None:
        other = decoder.add_request(torch.randint(3, VOCAB, (5,), generator=torch.Generator().manual_seed(3)),
                                    max_new_tokens=10, do_sample=mate == "sampled", seed=1, eos_token_id=None)
    while decoder.has_work():
        decoder.step()
    result = decoder.result(greedy)
    assert result.finish_reason != "error" and result.token_ids == expected, result.error
    if mate == "sampled":
        assert decoder.result(other).finish_reason == "error" and "probability 0" in decoder.result(other).error


class Refilled(Scripted):
    """Proposes 1, 3, 1, 3, ... of its tokens per row; ``observe`` prepares the next count in place (a static
    buffer, as a captured drafter keeps) or in a new tensor."""

    def __init__(self, in_place):
        super().__init__(None)
        self.in_place = in_place

    def start(self, input_ids, real):
        self.batch = input_ids.shape[0]
        self.count = torch.ones(self.batch, dtype=torch.int64)

    def propose(self, gamma, choose):
        return _tokens(self.batch, gamma), None, self.count if gamma == 3 else self.count.clamp(max=gamma)

    def observe(self, out, accepted, finished):
        if self.in_place:
            self.count.copy_(4 - self.count)
        else:
            self.count = 4 - self.count


def test_a_drafter_refilling_its_buffers_in_observe_gets_the_same_statistics(target):
    """The per-row counts were read for the statistics in the host read after ``observe``: a drafter preparing its
    next proposal in place there (as the protocol invites) was counted the next proposal's drafts."""
    ids = torch.randint(3, VOCAB, (2, 8), generator=torch.Generator().manual_seed(4))
    stats = {}
    for in_place in (False, True):
        stats[in_place] = sk.SpeculationStats()
        sk.generate(target, ids, drafter=Refilled(in_place), num_speculative_tokens=3, max_new_tokens=20,
                    do_sample=False, eos_token_id=None, pad_token_id=0, speculation_stats=stats[in_place])
    assert stats[True].drafted_tokens == stats[False].drafted_tokens
    assert (stats[True].accept_tests, stats[True].accept_tests_passed) == \
        (stats[False].accept_tests, stats[False].accept_tests_passed)


class LastToken(Scripted):
    """Proposes each row's last emitted token, read in ``observe`` as out[b, accepted[b]]; its ``bad_at``-th
    proposal puts an id outside the vocabulary in row 0."""

    def __init__(self, bad_at=3):
        super().__init__(None)
        self.bad_at, self.proposals = bad_at, 0

    def start(self, input_ids, real):
        self.batch, self.last = input_ids.shape[0], input_ids[:, -1].clone()

    def propose(self, gamma, choose):
        self.proposals += 1
        tokens = self.last.unsqueeze(1).expand(-1, gamma).clone()
        if self.proposals == self.bad_at:
            tokens[0] = 5000
        return tokens, None, None

    def observe(self, out, accepted, finished):
        n = torch.zeros_like(finished, dtype=torch.int64) if accepted is None else accepted
        self.last = torch.where(finished, self.last, out.gather(1, n.unsqueeze(1))[:, 0])

    def select_rows(self, index):
        self.batch, self.last = index.numel(), self.last.index_select(0, index)

    def add_rows(self, other):
        self.batch, self.last = self.batch + other.batch, torch.cat([self.last, other.last])


def test_observe_never_sees_accepted_minus_one(target):
    """A row with an invalid proposal reached observe with accepted -1 (out all -1): a drafter reading
    out[b, accepted[b]] raised an IndexError inside torch instead of the loop's reason, and in continuous batching
    every running request failed with it. Such a row is now passed as finished, with accepted 0."""
    ids = torch.randint(3, VOCAB, (2, 8), generator=torch.Generator().manual_seed(5))
    with pytest.raises(ValueError, match=r"the drafter LastToken proposed token ids outside"):
        sk.generate(target, ids, drafter=LastToken(), num_speculative_tokens=3, max_new_tokens=12, do_sample=False,
                    eos_token_id=None, pad_token_id=0)
    decoder = sk.SpeculativeDecoder(target, drafter=LastToken, num_speculative_tokens=3)
    bad = decoder.add_request(ids[0], max_new_tokens=12, do_sample=False, eos_token_id=None)
    good = decoder.add_request(ids[1], max_new_tokens=12, do_sample=False, eos_token_id=None)
    while decoder.has_work():
        decoder.step()
    assert decoder.result(bad).finish_reason == "error" and "outside the target's vocabulary" in \
        decoder.result(bad).error
    expected = target.generate(ids[1:], max_new_tokens=12, do_sample=False, eos_token_id=None)[0, 8:].tolist()
    assert decoder.result(good).finish_reason != "error" and decoder.result(good).token_ids == expected


@pytest.mark.parametrize("drafter,words", [
    (lambda: Scripted(lambda b, g: (_tokens(b, g), None, None)), r"function has no start, propose.* \(a callable: "
                                                                 r"generate\(\) takes a Drafter instance"),
    (Scripted, r"got the class Scripted: pass Scripted\(\.\.\.\)"),
    (object(), r"object has no start, propose, observe"),
])
def test_generate_refuses_a_factory_or_a_class_for_the_drafter_before_the_prefill(target, drafter, words,
                                                                                  monkeypatch):
    """generate takes an instance, SpeculativeDecoder a factory: a factory passed to generate failed after the
    target's prefill with "'function' object has no attribute 'start'"."""
    def no_prefill(*args, **kwargs):
        raise AssertionError("the prefill ran")

    monkeypatch.setattr(loop_module.SpeculativeLoop, "_prefill", no_prefill)
    with pytest.raises(TypeError, match=words):
        sk.generate(target, _ids(), drafter=drafter, num_speculative_tokens=3, max_new_tokens=8, do_sample=False)


def test_a_subclass_of_the_drafter_protocol_runs_with_its_defaults(target):
    """``class Mine(sk.Drafter)`` defining start and propose: the protocol's forwards/compactions returned None,
    and generation failed at its end adding None to the statistics."""
    class Mine(sk.Drafter):
        def start(self, input_ids, real):
            self.batch = input_ids.shape[0]

        def propose(self, gamma, choose):
            return _tokens(self.batch, gamma), None, None

    stats = sk.SpeculationStats()
    got = sk.generate(target, _ids(), drafter=Mine(), num_speculative_tokens=3, max_new_tokens=8, do_sample=False,
                      speculation_stats=stats)
    assert torch.equal(got, target.generate(_ids(), max_new_tokens=8, do_sample=False))
    assert stats.compactions == 0 and stats.draft_forwards == 0


def test_a_subclass_of_prompt_lookup_overriding_propose_is_checked(target):
    """PromptLookupDrafter's ids are valid by construction, so its proposals' values are not checked; a subclass
    inherited that trust, and its id outside the vocabulary reached the embedding (IndexError inside torch; a
    device-side assert on CUDA)."""
    class Tweaked(sk.PromptLookupDrafter):
        def propose(self, gamma, choose):
            tokens, logits, num_draft = super().propose(gamma, choose)
            return torch.full_like(tokens, 5000), logits, torch.full_like(num_draft, gamma)

    with pytest.raises(ValueError, match=r"the drafter Tweaked proposed token ids outside the target's vocabulary"):
        sk.generate(target, _ids(), drafter=Tweaked(3, 2), num_speculative_tokens=3, max_new_tokens=8,
                    do_sample=False)


class Counted(Scripted):
    """Proposes a fixed token, and reports ``counts`` as its proposal_counts()."""

    def __init__(self, counts):
        super().__init__(lambda b, g: (_tokens(b, g), None, None))
        self.counts = counts

    def proposal_counts(self):
        return self.counts


@pytest.mark.parametrize("counts,words", [
    ([2, 2], r"returned 2 counts; it must give one per row \(B = 1\)"),
    ([-1], r"returned \[-1\]; counts must be ints >= 0"),
    (3, r"returned int; it must be a list"),
    (torch.tensor([2]), r"returned Tensor; it must be a list"),
])
def test_proposal_counts_of_another_length_or_negative_are_refused_by_name(target, counts, words):
    """A wrong length failed with an IndexError in the statistics after the target's forward; negative counts
    called propose(-1, ...); an int failed iterating it."""
    with pytest.raises((ValueError, TypeError), match=r"Counted\.proposal_counts\(\) " + words):
        sk.generate(target, _ids(), drafter=Counted(counts), num_speculative_tokens=3, max_new_tokens=8,
                    do_sample=False)


def test_proposal_counts_as_numpy_integers_are_taken(target):
    import numpy as np

    got = sk.generate(target, _ids(), drafter=Counted([np.int64(2)]), num_speculative_tokens=3, max_new_tokens=8,
                      do_sample=False)
    assert torch.equal(got, target.generate(_ids(), max_new_tokens=8, do_sample=False))


class Choosing(Scripted):
    """A drafter that draws through ``choose`` from logits of ``shape(batch)`` (zeros)."""

    def __init__(self, shape):
        super().__init__(None)
        self.shape = shape

    def propose(self, gamma, choose):
        logits = torch.zeros(self.shape(self.batch))
        return choose(logits, 0).reshape(self.batch, 1).expand(self.batch, gamma).contiguous(), None, None


@pytest.mark.parametrize("shape,words", [
    (lambda b: (b, VOCAB - 1), r"shape \(2, 96\)"), (lambda b: (b, 1, VOCAB), r"shape \(2, 1, 97\)"),
    (lambda b: (VOCAB,), r"shape \(97,\)"), (lambda b: (b + 1, VOCAB), r"shape \(3, 97\)")])
@pytest.mark.parametrize("do_sample", [False, True])
def test_logits_of_another_shape_given_to_choose_are_refused_by_name(target, shape, words, do_sample):
    """choose() took any tensor: another width or batch failed inside torch (a broadcast in the logit masks or
    the sampler)."""
    ids = torch.randint(3, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"Choosing called choose\(logits, 0\) with logits of " + words +
                       r".*shape \[2, 97\] here"):
        sk.generate(target, ids, drafter=Choosing(shape), num_speculative_tokens=3, max_new_tokens=6,
                    min_new_tokens=5, do_sample=do_sample)


def test_a_drafter_factory_returning_one_instance_is_refused_by_name(target):
    """A SpeculativeDecoder factory that returns the same drafter every call gave a joining loop the running
    batch's drafter, whose rows then failed every running request with a shape error."""
    shared = Choosing(lambda b: (b, VOCAB))
    decoder = sk.SpeculativeDecoder(target, drafter=lambda: shared, num_speculative_tokens=3)
    first = decoder.add_request([5, 6, 7], max_new_tokens=8, do_sample=False)
    decoder.step()
    second = decoder.add_request([8, 9], max_new_tokens=8, do_sample=False)
    while decoder.has_work():
        decoder.step()
    assert decoder.result(first).finish_reason == "length"
    assert decoder.result(first).token_ids == target.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=8,
                                                              do_sample=False)[0, 3:].tolist()
    result = decoder.result(second)
    assert result.finish_reason == "error" and "returned the Choosing the running batch already uses" in result.error


def test_a_subclass_without_select_rows_or_add_rows_is_told_so():
    """sk.Drafter's select_rows/add_rows did nothing: a subclass defining only start and propose failed when a row
    left the batch with a shape error blamed on propose, and passed add_request's add_rows check, then failed both
    requests when one joined. The inherited ones raise naming what is missing; add_request refuses it up front."""
    class Mine(sk.Drafter):
        def start(self, input_ids, real):
            self.batch = input_ids.shape[0]

        def propose(self, gamma, choose):
            return _tokens(self.batch, gamma), None, None

    target = llama()
    ids = torch.randint(3, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    eos = int(target.generate(ids[:1], max_new_tokens=2, do_sample=False)[0, -1])  # row 0 stops after 2 tokens
    with pytest.raises(NotImplementedError, match="Mine does not implement Drafter.select_rows"):
        sk.generate(target, ids, drafter=Mine(), num_speculative_tokens=3, max_new_tokens=8, do_sample=False,
                    eos_token_id=eos, pad_token_id=0)
    decoder = sk.SpeculativeDecoder(target, drafter=Mine, num_speculative_tokens=3)
    with pytest.raises(ValueError, match="add_request needs a drafter with add_rows.*Mine has none"):
        decoder.add_request([5, 6, 7], max_new_tokens=4)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_q_is_ignored_greedy_and_refused_sampling(target, bad):
    """Greedy verification does not read q: a draft whose logits overflow (inf/NaN, e.g. a float16 draft) was
    refused ('draft_logits has NaN, +inf or an all -inf row') where HF's greedy assisted generation runs; greedy now
    gives model.generate's tokens. Sampling still refuses it (q is its distribution)."""
    def script(batch, gamma):
        q = torch.zeros(batch, gamma, VOCAB)
        q[:, :, :] = bad if bad == float("-inf") else 0.0
        q[:, :, 3] = bad
        return _tokens(batch, gamma, 3), q, None

    ids = torch.randint(3, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    expected = target.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    got = sk.generate(target, ids, drafter=Scripted(script), num_speculative_tokens=3, max_new_tokens=8,
                      do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(got, expected)
    with pytest.raises(ValueError, match="draft_logits, the drafter's logits \\(Scripted\\), has NaN, \\+inf or an "
                                         "all -inf row"):
        sk.generate(target, ids, drafter=Scripted(script), num_speculative_tokens=3, max_new_tokens=8,
                    do_sample=True, seed=0, eos_token_id=None, pad_token_id=0)
