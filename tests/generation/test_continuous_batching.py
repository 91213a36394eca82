"""Continuous batching on ``SpeculativeDecoder`` (``add_request`` / ``step`` / ``cancel`` / ``result``): requests
with their own settings and seeds join and leave a running batch, and each one's output is what it would be alone:
greedy ones token-identical to ``model.generate``, seeded sampled ones to ``speculative_kernels.generate`` with the
same seed (whole output); per-row sampling follows each row's warped target distribution (chi-square)."""

import copy

import numpy as np
import pytest
import torch

import speculative_kernels as sk
from helpers.continuous import alone, run_arrivals
from helpers.host_reads import count_reads_per_loop_step
from helpers.models import llama
from helpers.sampling import hf_warpers
from helpers.stats import assert_matches

# CUDA when there is one (gpu.py runs these files there: continuous batching on the GPU), else the CPU.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
GAMMA = 3


@pytest.fixture(scope="module")
def pair():
    return llama().to(DEVICE), llama(layers=1, seed=2).to(DEVICE)


def spread(seed: int, layers: int, vocab: int = 8):
    """A Llama over a small vocabulary with spread-out next-token distributions and no EOS (sampled outputs of
    different settings and seeds differ; first-token distributions are easy to test)."""
    model = llama(layers=layers, vocab=vocab, seed=seed).to(DEVICE)
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    model.generation_config.eos_token_id = None
    return model


def _alone(pair, prompt, settings):
    """The request decoded alone: model.generate when greedy, else speculative_kernels.generate with its seed."""
    return alone(*pair, prompt, settings, GAMMA, DEVICE)


def test_requests_joining_at_different_steps_match_each_request_alone(pair):
    """Greedy and seeded sampled requests of different lengths and settings, arriving at different steps (some
    while others run, one after the batch emptied): each one's streamed and final tokens are its output alone."""
    target, draft = pair
    decoder = sk.SpeculativeDecoder(target, draft, num_speculative_tokens=GAMMA)
    arrivals = {
        0: [([5, 6, 7, 8], dict(max_new_tokens=13, do_sample=False)),
            ([9, 10], dict(max_new_tokens=11, do_sample=True, temperature=0.8, seed=3))],
        2: [([11, 12, 13, 14, 15, 16], dict(max_new_tokens=9, do_sample=True, top_k=5, seed=4)),
            ([17], dict(max_new_tokens=7, do_sample=False))],
        5: [([20, 21, 22], dict(max_new_tokens=10, do_sample=True, temperature=1.3, top_p=0.8, seed=5))],
        6: [([30, 31], dict(max_new_tokens=1, do_sample=True, seed=6)),
            ([32, 33, 34], dict(max_new_tokens=2, do_sample=False))],
        40: [([40, 41, 42], dict(max_new_tokens=8, do_sample=True, temperature=0.7, seed=7))],
    }
    requests, streamed = run_arrivals(decoder, arrivals)
    assert len(requests) == 8
    for request_id, (prompt, settings) in requests.items():
        expected = _alone(pair, prompt, settings)
        result = decoder.result(request_id)
        assert result.token_ids == expected, (prompt, settings)
        assert streamed[request_id] == expected
        assert result.finish_reason == "length" and result.prompt_ids == prompt
        assert result.iterations >= 1 and 0 <= result.accepted_tokens <= result.drafted_tokens
    assert decoder.running == [] and decoder.queued == []


def test_sampled_requests_near_their_end_match_each_request_alone():
    """Models that accept some drafts and reject others, many seeded requests of different lengths in one batch:
    rows near their end are drafted fewer tokens than their batch-mates (their own tokens left, less one), give
    the unused draft offsets back and go on drawing what they would draw alone, up to their last token."""
    target, draft = spread(0, 2), spread(7, 1)
    decoder = sk.SpeculativeDecoder(target, draft, num_speculative_tokens=GAMMA)
    arrivals = {0: [([1, 4, 3, 5], dict(max_new_tokens=5 + 3 * i, do_sample=True, temperature=0.8, seed=100 + i))
                    for i in range(8)],
                3: [([2, 6], dict(max_new_tokens=4 + 5 * i, do_sample=True, top_k=4, seed=200 + i)) for i in range(4)]}
    requests, streamed = run_arrivals(decoder, arrivals)
    for request_id, (prompt, settings) in requests.items():
        assert streamed[request_id] == _alone((target, draft), prompt, settings), (prompt, settings)


def test_requests_with_their_own_eos_finish_with_eos(pair):
    """eos_token_id per request: the greedy request stops at its own EOS as model.generate does; a batch-mate
    with another EOS (or none) is not cut by it."""
    target, draft = pair
    prompt = [5, 6, 7, 8]
    free = _alone(pair, prompt, dict(max_new_tokens=12, do_sample=False))
    eos = free[4]
    decoder = sk.SpeculativeDecoder(target, draft, num_speculative_tokens=GAMMA)
    stopped = decoder.add_request(prompt, max_new_tokens=12, do_sample=False, eos_token_id=eos)
    other = decoder.add_request(prompt, max_new_tokens=12, do_sample=False, eos_token_id=[96])
    while decoder.has_work():
        decoder.step()
    assert decoder.result(stopped).token_ids == _alone(pair, prompt, dict(max_new_tokens=12, do_sample=False,
                                                                          eos_token_id=eos))
    assert decoder.result(stopped).token_ids == free[: free.index(eos) + 1]
    assert decoder.result(stopped).finish_reason == "eos"
    assert decoder.result(other).token_ids == free and decoder.result(other).finish_reason == "length"


def test_min_new_tokens_per_request(pair):
    """min_new_tokens per request: EOS is masked for that row only until its own minimum (as HF's
    MinNewTokensLength), also across the merge when another request joins in its masked window; greedy requests
    are model.generate, seeded sampled ones generate with their seed."""
    target, _ = pair
    prompt = [5, 6, 7, 8]
    free = _alone(pair, prompt, dict(max_new_tokens=12, do_sample=False))
    eos = free[1]  # the free run would stop at its second token
    decoder = sk.SpeculativeDecoder(*pair, num_speculative_tokens=GAMMA)
    arrivals = {0: [(prompt, dict(max_new_tokens=12, do_sample=False, eos_token_id=eos, min_new_tokens=6)),
                    (prompt, dict(max_new_tokens=12, do_sample=False, eos_token_id=eos)),
                    ([9, 10], dict(max_new_tokens=14, do_sample=True, eos_token_id=[eos, 7], min_new_tokens=9,
                                   seed=2))],
                1: [([11, 12, 13], dict(max_new_tokens=6, do_sample=False, min_new_tokens=6, eos_token_id=eos))]}
    requests, streamed = run_arrivals(decoder, arrivals)
    outputs = []
    for request_id, (prompt_ids, settings) in requests.items():
        expected = _alone(pair, prompt_ids, settings)
        assert streamed[request_id] == expected, settings
        outputs.append(expected)
    assert len(outputs[0]) > 2 and eos not in outputs[0][:6]
    assert outputs[1] == free[:2]


def test_min_new_tokens_left_is_carried_across_a_merge(pair):
    """A request whose EOS comes exactly at its minimum: when another request joins (its rows are merged in) after it
    has generated some tokens, its minimum still counts its own tokens, so it still stops there."""
    target, _ = pair
    prompt = [5, 6, 7, 8]
    free = _alone(pair, prompt, dict(max_new_tokens=16, do_sample=False))
    at = next(i for i in range(4, 16) if free[i] not in free[:i])
    settings = dict(max_new_tokens=16, do_sample=False, eos_token_id=free[at], min_new_tokens=at)
    decoder = sk.SpeculativeDecoder(*pair, num_speculative_tokens=GAMMA)
    requests, streamed = run_arrivals(decoder, {0: [(prompt, settings)], 1: [([9, 10], dict(max_new_tokens=4))]})
    first = next(iter(requests))
    assert streamed[first] == _alone(pair, prompt, settings) == free[: at + 1]
    assert decoder.result(first).finish_reason == "eos"


def test_mixed_sampling_settings_follow_each_rows_distribution():
    """One batch of many requests, each row with its own temperature / top-k / top-p / seed: the first token of the
    requests of each setting follows the target's warped distribution for that setting (chi-square), so no row
    samples with a batch-mate's settings."""
    target, draft = spread(0, 2), spread(7, 1)
    prompt = [1, 4, 3, 5]
    settings = [dict(temperature=0.5), dict(temperature=1.0), dict(temperature=1.5), dict(temperature=1.0, top_k=3),
                dict(temperature=1.0, top_p=0.6)]
    per_setting = 300
    decoder = sk.SpeculativeDecoder(target, draft, num_speculative_tokens=GAMMA,
                                    max_batch_size=per_setting * len(settings))
    ids = {}
    for trial in range(per_setting):
        for index, setting in enumerate(settings):
            ids[decoder.add_request(prompt, max_new_tokens=2, do_sample=True, seed=trial * 10 + index,
                                    **({"top_k": 0} | setting))] = index
    while decoder.has_work():
        decoder.step()
    firsts = [[] for _ in settings]
    for request_id, index in ids.items():
        firsts[index].append(decoder.result(request_id).token_ids[0])
    with torch.no_grad():
        logits = target(torch.tensor([prompt], device=DEVICE)).logits[:, -1].double()
    for index, setting in enumerate(settings):
        warp = hf_warpers(setting["temperature"], setting.get("top_k", 0), setting.get("top_p", 1.0))
        probs = warp(torch.tensor([prompt], device=DEVICE), logits.clone()).softmax(-1)[0].cpu().numpy()
        assert_matches(np.bincount(firsts[index], minlength=8), probs)


def test_cancel_frees_the_row_and_the_caches_stay_bounded(pair):
    """A long request runs while 20 others join, run two steps and are cancelled: each cancel removes the row at
    once, and the caches stay sized for what is running (no growth with the number of requests served)."""
    target, draft = pair
    decoder = sk.SpeculativeDecoder(target, draft, num_speculative_tokens=GAMMA)
    long = decoder.add_request([5, 6, 7], max_new_tokens=120, do_sample=False)
    widths = []
    for cycle in range(20):  # (EOS banned for the two steps' tokens, whatever a seed draws: it runs until cancelled)
        short = decoder.add_request([8 + cycle, 9, 10, 11, 12], max_new_tokens=50, do_sample=True, seed=cycle,
                                    min_new_tokens=2 * (GAMMA + 1))
        decoder.step()
        decoder.step()
        assert decoder.running == [long, short]
        assert decoder.cancel(short)
        assert decoder.running == [long]
        loop = decoder._batcher._loop
        assert loop.batch == 1 and loop.target_runner.slot_mask.shape[0] == 1
        assert loop.sequences.shape[0] == 1
        context = 3 + len(decoder.result(long).token_ids)
        widths.append(loop.target_runner.num_slots)
        assert loop.target_runner.num_slots <= context + 5 + GAMMA + 1  # the longest row's context: no leftovers
        result = decoder.result(short)
        assert result.finish_reason == "cancelled" and 2 <= len(result.token_ids) <= 2 * (GAMMA + 1)
        assert not decoder.cancel(short)  # already finished
    while decoder.has_work():
        decoder.step()
    assert decoder.result(long).token_ids == _alone(pair, [5, 6, 7], dict(max_new_tokens=120, do_sample=False))


def test_cancel_of_a_queued_request_and_the_queue_bound(pair):
    target, draft = pair
    decoder = sk.SpeculativeDecoder(target, draft, num_speculative_tokens=GAMMA, max_batch_size=2)
    a, b, c, d = (decoder.add_request([5, 6 + i], max_new_tokens=4, do_sample=False) for i in range(4))
    assert decoder.queued == [a, b, c, d] and decoder.result(a).finish_reason is None
    decoder.step()
    assert decoder.running == [a, b] and decoder.queued == [c, d]
    assert decoder.cancel(c)
    assert decoder.queued == [d] and decoder.result(c).finish_reason == "cancelled"
    assert decoder.result(c).token_ids == []
    while decoder.has_work():
        decoder.step()
    for request_id in (a, b, d):
        assert decoder.result(request_id).token_ids == _alone(pair, decoder.result(request_id).prompt_ids,
                                                               dict(max_new_tokens=4, do_sample=False))
    zero = decoder.add_request([5], max_new_tokens=0)
    assert decoder.result(zero).finish_reason == "length" and not decoder.has_work()
    assert decoder.step() == {}
    decoder.release(a)
    with pytest.raises(ValueError, match="unknown request_id 0"):
        decoder.result(a)


def test_a_tokenizer_row_is_a_prompt(pair):
    """prompt_ids as a tokenizer's return_tensors="pt" gives them, [1, n]: the same request as its list."""
    decoder = sk.SpeculativeDecoder(*pair, num_speculative_tokens=GAMMA)
    greedy = dict(max_new_tokens=5, do_sample=False)
    request = decoder.add_request(torch.tensor([[5, 6, 7]]), **greedy)
    while decoder.has_work():
        decoder.step()
    assert decoder.result(request).prompt_ids == [5, 6, 7]
    assert decoder.result(request).token_ids == _alone(pair, [5, 6, 7], greedy)


@pytest.mark.parametrize("call, error, message", [
    (lambda d: d.result(99), ValueError, "unknown request_id 99"),
    (lambda d: d.cancel("x"), TypeError, "request_id must be an int returned by add_request, got str"),
    (lambda d: d.add_request([1, 2], min_new_tokens=2.5), TypeError, "min_new_tokens"),
    (lambda d: d.add_request([1, 2], stop_strings=["a"]), ValueError, "stop_strings needs the decoder.s tokenizer"),
    (lambda d: d.add_request([1, 2], num_beams=2), ValueError, "num_beams is not a keyword add_request takes"),
    (lambda d: d.add_request([1, 2], cache_implementation="static"), ValueError, "cache_implementation is not a"),
    (lambda d: d.add_request(torch.ones(2, 3, dtype=torch.int64)), ValueError, "holds 2 prompts .* call it once"),
    (lambda d: d.add_request(torch.ones(1, 1, 3, dtype=torch.int64)), ValueError, "1-D integer tensor"),
    (lambda d: d.add_request(torch.ones(3)), ValueError, "dtype torch.float32"),
    (lambda d: d.add_request([]), ValueError, "at least one token"),
    (lambda d: d.add_request([1, 2.0]), TypeError, "list of ints"),
    (lambda d: d.add_request("hello"), TypeError, "got str"),
    (lambda d: d.add_request([1, 500]), ValueError, r"prompt_ids must be in \[0, 97\)"),
    (lambda d: d.add_request([1, 97]), ValueError, r"prompt_ids must be in \[0, 97\)"),  # (one past the last id)
    (lambda d: d.add_request([1, 2], seed=-1), ValueError, "seed must be in"),
    (lambda d: d.add_request([1, 2], do_sample=True, temperature=-1.0), ValueError, "temperature"),
    (lambda d: d.add_request([1, 2], max_new_tokens=-1), ValueError, "max_new_tokens"),
])
def test_bad_ids_and_arguments_are_refused_by_name(pair, call, error, message):
    decoder = sk.SpeculativeDecoder(*pair, num_speculative_tokens=GAMMA)
    with pytest.raises(error, match=message):
        call(decoder)
    assert not decoder.has_work()


def test_a_decoder_with_nothing_to_draft_with_is_refused_by_add_request(pair):
    """SpeculativeDecoder(target) with no draft model, drafter, prompt lookup or early exit: add_request accepted its
    requests, and each finished with finish_reason "error" at its step. add_request now refuses it by name; a
    checkpoint's prompt_lookup_num_tokens or assistant_early_exit still drafts."""
    target, _ = pair
    decoder = sk.SpeculativeDecoder(target)
    with pytest.raises(ValueError, match="nothing to draft with"):
        decoder.add_request([5, 6, 7], max_new_tokens=3)
    assert not decoder.has_work()
    for field in ("prompt_lookup_num_tokens", "assistant_early_exit"):
        model = copy.deepcopy(target)
        setattr(model.generation_config, field, 1)
        decoder = sk.SpeculativeDecoder(model)
        request = decoder.add_request([5, 6, 7], max_new_tokens=3, do_sample=False)
        while decoder.has_work():
            decoder.step()
        assert decoder.result(request).finish_reason == "length", field


def test_release_of_a_running_request_and_bad_batch_sizes(pair):
    decoder = sk.SpeculativeDecoder(*pair, num_speculative_tokens=GAMMA)
    request_id = decoder.add_request([1, 2], max_new_tokens=5)
    with pytest.raises(ValueError, match="still queued"):
        decoder.release(request_id)
    decoder.step()
    with pytest.raises(ValueError, match="still running"):
        decoder.release(request_id)
    for bad in (0, True, 2.0):
        with pytest.raises(ValueError, match="max_batch_size must be an int >= 1"):
            sk.SpeculativeDecoder(*pair, max_batch_size=bad)


@pytest.mark.parametrize("options", [dict(prompt_lookup_num_tokens=3), dict(num_speculative_tokens="auto")])
def test_prompt_lookup_and_auto_gamma_requests_match_generate(pair, options):
    """Without a draft model (prompt lookup: per-row proposal counts, combined with the per-row limits) and with
    gamma calibrated on the first batch and kept as requests join ("auto"), greedy requests joining at different
    steps are model.generate."""
    target, draft = pair
    decoder = sk.SpeculativeDecoder(target, None if "prompt_lookup_num_tokens" in options else draft, **options)
    arrivals = {i: [(prompt, dict(max_new_tokens=10 + 3 * i, do_sample=False))]
                for i, prompt in enumerate([[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 9, 10, 9], [3, 4]])}
    requests, streamed = run_arrivals(decoder, arrivals)
    for request_id, (prompt, settings) in requests.items():
        assert streamed[request_id] == _alone(pair, prompt, settings)


def _forward_shapes(model):
    """Record [B, T] of every forward of ``model`` (a pre-hook); returns (shapes list, hook handle)."""
    shapes = []

    def hook(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        shapes.append(tuple(ids.shape))

    return shapes, model.register_forward_pre_hook(sk.per_token_hook(hook), with_kwargs=True)


def test_a_joining_request_gets_its_first_tokens_from_the_admitting_step_on_its_own_rows(pair):
    """Time to first token: the step that admits a request while another runs prefills it on its own row (its
    prompt but the last token, in both models) and runs its first iteration on that row alone, so it returns the
    joining request's first tokens after its own prefill and iteration, not one of the whole batch (the merge of the
    previous version ran the batch's step of both rows here); a greedy request's first token comes from the target's
    forward over its whole prompt (its prefill). The running row emits again at the next step, where the two rows
    share one verification and the running context is not forwarded again. A request that finishes in its first
    iteration (max_new_tokens=1) never joins. Outputs are each request's alone."""
    target, draft = pair
    decoder = sk.SpeculativeDecoder(target, draft, num_speculative_tokens=GAMMA)
    running = decoder.add_request([5, 6, 7, 8, 9, 10], max_new_tokens=40, do_sample=False)
    for _ in range(4):
        decoder.step()
    joining_prompt = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30]
    joining = decoder.add_request(joining_prompt, max_new_tokens=12, do_sample=True, seed=9)
    (target_shapes, target_hook), (draft_shapes, draft_hook) = _forward_shapes(target), _forward_shapes(draft)
    try:
        admitted = decoder.step()
        assert set(admitted) == {joining} and admitted[joining]  # its first tokens, from the admitting step
        prefill = (1, len(joining_prompt) - 1)
        assert target_shapes == [prefill, (1, GAMMA + 1)]  # the joining row alone: prefill, one verification
        assert draft_shapes[0] == prefill and all(shape[0] == 1 for shape in draft_shapes)
        assert decoder.running == [running, joining]
        del target_shapes[:], draft_shapes[:]
        after = decoder.step()
        assert set(after) == {running, joining}
        assert target_shapes == [(2, GAMMA + 1)]  # then one verification of both rows
        assert all(shape[0] == 2 and shape[1] <= 2 for shape in draft_shapes)
        one = decoder.add_request([3, 4], max_new_tokens=1, do_sample=False)
        del target_shapes[:]
        assert set(decoder.step()) == {one}
        assert target_shapes == [(1, 2)]  # max_new_tokens=1: one forward over its prompt, as model.generate
        assert decoder.result(one).finish_reason == "length" and decoder.running == [running, joining]
        # a greedy request takes its first token from the target's forward over its whole prompt (nothing drafted),
        # as model.generate does: the admitting step is its prefill (the draft's without the last token)
        greedy_prompt = [31, 32, 33, 34, 35, 36, 37]
        greedy = decoder.add_request(greedy_prompt, max_new_tokens=9, do_sample=False)
        del target_shapes[:], draft_shapes[:]
        admitted = decoder.step()
        assert set(admitted) == {greedy} and len(admitted[greedy]) == 1
        assert target_shapes == [(1, len(greedy_prompt))] and draft_shapes == [(1, len(greedy_prompt) - 1)]
        assert decoder.running == [running, joining, greedy]
    finally:
        target_hook.remove()
        draft_hook.remove()
    while decoder.has_work():
        decoder.step()
    assert decoder.result(running).token_ids == _alone(pair, [5, 6, 7, 8, 9, 10],
                                                         dict(max_new_tokens=40, do_sample=False))
    assert decoder.result(joining).token_ids == _alone(pair, joining_prompt,
                                                         dict(max_new_tokens=12, do_sample=True, seed=9))
    assert decoder.result(one).token_ids == _alone(pair, [3, 4], dict(max_new_tokens=1, do_sample=False))
    assert decoder.result(greedy).token_ids == _alone(pair, greedy_prompt, dict(max_new_tokens=9, do_sample=False))


def _drafting(kind, target, draft):
    """(SpeculativeDecoder keywords, sk.generate keywords) of each way of drafting."""
    if kind == "draft model":
        return dict(draft=draft, num_speculative_tokens=GAMMA), dict(draft_model=draft, num_speculative_tokens=GAMMA)
    if kind == "prompt lookup":
        return dict(prompt_lookup_num_tokens=GAMMA), dict(prompt_lookup_num_tokens=GAMMA)
    return (dict(drafter=lambda: sk.NGramDrafter.for_model(target), num_speculative_tokens=GAMMA),
            dict(drafter=sk.NGramDrafter.for_model(target), num_speculative_tokens=GAMMA))


@pytest.mark.parametrize("kind", ["draft model", "prompt lookup", "n-gram"])
def test_rows_joining_with_longer_and_shorter_contexts_match_each_request_alone(pair, kind):
    """The merge path with every drafter kind: a request with a longer context than the running rows joins (the
    running rows' caches get holes on the left), then, after a row has left, shorter ones (the joining rows get
    them), a group of greedy requests only (first token from their prefill), and requests of one and two tokens (a
    one-token loop defers its prefill); greedy requests are model.generate, seeded sampled ones generate alone with
    their seed."""
    target, draft = pair
    decoder_kwargs, alone_kwargs = _drafting(kind, target, draft)
    decoder = sk.SpeculativeDecoder(target, **decoder_kwargs)
    long_prompt = [(7 * i) % 90 + 3 for i in range(28)]
    arrivals = {
        0: [([5, 6, 7], dict(max_new_tokens=30, do_sample=False)),
            ([8, 9, 8, 9], dict(max_new_tokens=5, do_sample=True, temperature=0.9, seed=11))],
        2: [(long_prompt, dict(max_new_tokens=14, do_sample=False)),
            (long_prompt[:20], dict(max_new_tokens=9, do_sample=True, top_k=6, seed=12))],
        # greedy only: their first token comes from the target's forward over the prompts (nothing drafted)
        4: [([6, 7, 6, 7, 6, 7, 6], dict(max_new_tokens=9, do_sample=False)),
            (long_prompt[3:15], dict(max_new_tokens=7, do_sample=False))],
        7: [([4, 2], dict(max_new_tokens=8, do_sample=True, temperature=1.2, seed=13)),
            ([3], dict(max_new_tokens=6, do_sample=False))],
        8: [([10, 11, 12], dict(max_new_tokens=1, do_sample=True, seed=14)),
            ([13, 14], dict(max_new_tokens=1, do_sample=False)),
            ([15, 16, 17], dict(max_new_tokens=2, do_sample=False))],
    }
    requests, streamed = run_arrivals(decoder, arrivals)
    for request_id, (prompt, settings) in requests.items():
        ids = torch.tensor([prompt], device=DEVICE)
        if settings.get("do_sample"):
            expected = sk.generate(target, ids, pad_token_id=0, **alone_kwargs, **settings)[0, len(prompt):].tolist()
        else:
            expected = _alone(pair, prompt, settings)
        assert streamed[request_id] == expected, (prompt, settings)
        assert decoder.result(request_id).token_ids == expected


def test_one_host_read_per_iteration_after_rows_join(pair, monkeypatch):
    """Iterations of a batch that rows have joined (with holes on either side) still read the device once."""
    reads = count_reads_per_loop_step(monkeypatch)
    decoder = sk.SpeculativeDecoder(*pair, num_speculative_tokens=GAMMA)
    arrivals = {0: [([5, 6, 7], dict(max_new_tokens=20, do_sample=False))],
                2: [(list(range(3, 25)), dict(max_new_tokens=10, do_sample=True, min_new_tokens=4, seed=1))],
                4: [([9, 10], dict(max_new_tokens=6, do_sample=True, top_p=0.8, seed=2))]}
    run_arrivals(decoder, arrivals)
    assert len(reads) > 5 and all(r == ["tolist"] for r in reads), reads


def test_a_row_left_alone_has_its_holes_compacted(pair):
    """A long request joins a short running one (which gets the difference as holes on the left) and is cancelled:
    the row left alone has its holes squeezed out (the compactor stays on for a batch of one that had company), so
    it no longer attends over the other's slots; its tokens are still model.generate's."""
    target, draft = pair
    decoder = sk.SpeculativeDecoder(target, draft, num_speculative_tokens=GAMMA)
    short = decoder.add_request([5, 6, 7], max_new_tokens=40, do_sample=False)
    decoder.step()
    long = decoder.add_request([(3 * i) % 90 + 3 for i in range(120)], max_new_tokens=40, do_sample=False)
    decoder.step()
    runner = decoder._batcher._loop.target_runner
    assert runner.num_slots >= 120
    decoder.cancel(long)
    decoder.step()
    decoder.step()
    assert runner.compactions >= 1
    assert runner.num_slots <= 3 + len(decoder.result(short).token_ids) + 2 * (GAMMA + 1)
    while decoder.has_work():
        decoder.step()
    assert decoder.result(short).token_ids == _alone(pair, [5, 6, 7], dict(max_new_tokens=40, do_sample=False))


def _row_loop(pair, prompt, **kwargs):
    """A loop over one request with per-row settings, as ``add_request`` builds them."""
    from speculative_kernels.generation.request import build_loop
    from speculative_kernels.generation.row_settings import RowSettings
    from speculative_kernels.ops.randomness import request_key

    rows = RowSettings(max_new_tokens=[8], eos=[frozenset()], temperature=[0.0], top_k=[0], top_p=[1.0],
                       min_new_tokens=[0], keys=[request_key(1)], draft_offsets=[0], verify_offsets=[0])
    return build_loop(pair[0], pair[1], torch.tensor([prompt], device=DEVICE), num_speculative_tokens=GAMMA,
                      max_new_tokens=8, do_sample=False, pad_token_id=0, rows=rows, **kwargs)


def test_loops_that_cannot_share_a_batch_are_refused_unchanged(pair):
    """append_rows refuses by name what cannot merge, before changing anything: a loop without per-row settings (a
    start() batch) and rows beyond what a static cache was allocated for (here one row: continuous batching on the
    static cache allocates max_batch_size rows, ``test_continuous_static.py``); the running loop then steps on."""
    target, draft = pair
    decoder = sk.SpeculativeDecoder(target, draft, num_speculative_tokens=GAMMA)
    with torch.inference_mode():
        running = _row_loop(pair, [5, 6, 7])
        session = decoder.start(torch.tensor([[9, 10]], device=DEVICE), max_new_tokens=4, do_sample=False,
                                pad_token_id=0)
        with pytest.raises(ValueError, match="per-row settings"):
            running.append_rows(session.loop)
        static = _row_loop(pair, [5, 6, 7], cache_implementation="static")
        with pytest.raises(ValueError, match="cannot add 1 rows to a static cache of 1 rows allocated for 1"):
            static.append_rows(_row_loop(pair, [9, 10], cache_implementation="static"))
        for loop in (running, static):
            assert loop.batch == 1 and loop.target_runner.slot_mask.shape[0] == 1
            while loop.step():
                pass
            expected = _alone(pair, [5, 6, 7], dict(max_new_tokens=8, do_sample=False))
            assert loop.sequences[0, 3:11].tolist() == expected


@pytest.mark.parametrize("failure", [MemoryError("no room"), RuntimeError(
    "DefaultCPUAllocator: can't allocate memory: you tried to allocate 1048576 bytes. Error code 12")])
def test_requests_out_of_memory_wait_for_the_running_ones(pair, monkeypatch, failure):
    """Two requests queued together whose joint loop is out of memory: the first is admitted alone; the second, out
    of memory while it runs, waits (the running request keeps emitting; a serving loop is not stalled) and is
    admitted once it has left. Each one's tokens are its own alone. On the CPU, torch's allocator raises a
    RuntimeError, which was taken for the request's own failure (finished with "error" though it fits alone)."""
    from speculative_kernels import continuous

    real_build = continuous.build_loop
    decoder = sk.SpeculativeDecoder(*pair, num_speculative_tokens=GAMMA)

    def build_loop(target, draft, input_ids, **kwargs):  # room for one request's loop at a time
        if input_ids.shape[0] > 1 or decoder.running:
            raise failure
        return real_build(target, draft, input_ids, **kwargs)

    monkeypatch.setattr(continuous, "build_loop", build_loop)
    settings = [dict(max_new_tokens=9, do_sample=False), dict(max_new_tokens=6, do_sample=True, seed=4)]
    first, second = (decoder.add_request(p, **s) for p, s in zip(([5, 6, 7], [9, 10, 11, 12]), settings))
    tokens = {first: [], second: []}
    waited_while_first_emitted = 0
    while decoder.has_work():
        for request_id, new in decoder.step().items():
            tokens[request_id] += new
        waited_while_first_emitted += decoder.queued == [second] and decoder.running == [first]
    assert waited_while_first_emitted > 1
    for request_id, prompt, setting in ((first, [5, 6, 7], settings[0]), (second, [9, 10, 11, 12], settings[1])):
        result = decoder.result(request_id)
        assert result.finish_reason in ("eos", "length") and result.error is None
        assert tokens[request_id] == result.token_ids == _alone(pair, prompt, setting)


def test_a_request_that_cannot_be_admitted_fails_alone(pair, monkeypatch):
    """A request out of memory with nothing running, and one whose loop fails otherwise while another runs, each
    finish with finish_reason "error" and the reason; the requests behind and beside them are served as alone."""
    from speculative_kernels import continuous

    real_build = continuous.build_loop

    def build_loop(target, draft, input_ids, **kwargs):
        if (input_ids == 90).any():
            raise MemoryError("no room for 90")
        if (input_ids == 91).any():
            raise ValueError("91 is no good")
        return real_build(target, draft, input_ids, **kwargs)

    monkeypatch.setattr(continuous, "build_loop", build_loop)
    decoder = sk.SpeculativeDecoder(*pair, num_speculative_tokens=GAMMA)
    greedy = dict(max_new_tokens=8, do_sample=False)
    too_big, fine = decoder.add_request([90, 5], **greedy), decoder.add_request([5, 6, 7], **greedy)
    assert decoder.step() == {} and decoder.queued == [fine]
    decoder.step()
    failing = decoder.add_request([91, 5], **greedy)
    while decoder.has_work():
        decoder.step()
    for request_id, message in ((too_big, "MemoryError: no room for 90"), (failing, "ValueError: 91 is no good")):
        result = decoder.result(request_id)
        assert (result.finish_reason, result.error, result.token_ids) == ("error", message, [])
    assert decoder.result(fine).token_ids == _alone(pair, [5, 6, 7], greedy)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_a_request_whose_own_settings_leave_no_token_fails_alone(pair, cache):
    """A request whose logits have no admissible token (every id suppressed from the start; or, mid-run, every id
    used once under no_repeat_ngram_size=1 with no EOS) finishes with finish_reason "error" and the reason, its
    tokens so far kept; the requests beside it, admitted in the same step or running, are served as alone. (It made
    every step raise for the whole batch, and the loop, left half-updated, then fed -1 to the embedding.)"""
    options = dict(cache_implementation="static", max_context=128) if cache == "static" else {}
    decoder = sk.SpeculativeDecoder(*pair, num_speculative_tokens=GAMMA, **options)
    vocab = pair[0].config.vocab_size
    greedy = dict(max_new_tokens=6, do_sample=False)
    long = dict(max_new_tokens=110, do_sample=False, eos_token_id=None)
    good = decoder.add_request([9, 10], **greedy)
    suppressed = decoder.add_request([5, 6, 7], **greedy, suppress_tokens=list(range(vocab)))
    exhausted = decoder.add_request([5, 6, 8], **long, no_repeat_ngram_size=1)
    sampled = decoder.add_request([11, 12], max_new_tokens=100, do_sample=True, temperature=0.8, seed=3)
    while decoder.has_work():
        decoder.step()
    for request_id in (suppressed, exhausted):
        result = decoder.result(request_id)
        assert result.finish_reason == "error"
        assert result.error == ("ValueError: target_logits, the target's logits (LlamaForCausalLM) after the logits "
                                "processors and warpers of the settings, has NaN, +inf "
                                "or an all -inf row; no token emitted")
    assert decoder.result(suppressed).token_ids == []
    tokens = decoder.result(exhausted).token_ids
    assert len(tokens) == len(set(tokens)) and len(set(tokens) | {5, 6, 8}) == vocab  # every id used once
    assert decoder.result(good).token_ids == _alone(pair, [9, 10], greedy)
    assert decoder.result(sampled).token_ids == _alone(
        pair, [11, 12], dict(max_new_tokens=100, do_sample=True, temperature=0.8, seed=3))


@pytest.mark.parametrize("failure", [MemoryError("no room for the joined cache"),
                                     KeyboardInterrupt("no room for the joined cache")])
def test_a_merge_that_fails_midway_ends_the_running_and_joining_requests(pair, monkeypatch, failure):
    """An allocation failing inside the merge (here: the cache join raises MemoryError) leaves a half-joined loop:
    step raises it, and the running request and the joining one (which has emitted its first tokens already) finish
    with finish_reason "error" and their tokens so far; a request queued afterwards is then served, identical to
    itself alone. So does a Ctrl-C there (a KeyboardInterrupt is no Exception: the joining requests were lost, and
    a later request could be given a lost one's rows)."""
    from speculative_kernels.generation.runners import decoder as decoder_runner

    target, draft = pair
    decoder = sk.SpeculativeDecoder(target, draft, num_speculative_tokens=GAMMA)
    running = decoder.add_request([5, 6, 7], max_new_tokens=30, do_sample=False)
    decoder.step()
    joining = decoder.add_request([9, 10, 11, 12], max_new_tokens=6, do_sample=True, seed=4)

    def out_of_memory(*args):
        raise failure

    with monkeypatch.context() as patch:
        patch.setattr(decoder_runner, "append_cache_rows", out_of_memory)
        with pytest.raises(type(failure), match="no room"):
            decoder.step()
    for request_id in (running, joining):
        result = decoder.result(request_id)
        assert result.finish_reason == "error" and result.token_ids
        assert result.error == f"{type(failure).__name__}: no room for the joined cache"
    assert decoder.running == [] and decoder.queued == [] and not decoder.has_work()
    alone = dict(max_new_tokens=6, do_sample=True, seed=4)
    assert decoder.result(joining).token_ids == _alone(pair, [9, 10, 11, 12], alone)[: len(
        decoder.result(joining).token_ids)]
    later = decoder.add_request([9, 10, 11, 12], **alone)
    while decoder.has_work():
        decoder.step()
    assert decoder.result(later).token_ids == _alone(pair, [9, 10, 11, 12], alone)


def test_prompts_holding_the_pad_id_are_masked_as_model_generate_masks_them(pair):
    """model.generate on a prompt alone infers its mask from pad_token_id (0 here); a request is decoded as that,
    joining a running batch or not, and a prompt ending with the pad id is refused as generate refuses it."""
    target, draft = pair
    decoder = sk.SpeculativeDecoder(target, draft, num_speculative_tokens=GAMMA)
    prompts = {0: [[0, 0, 17, 42, 70, 7], [5, 9, 13]], 2: [[5, 17, 0, 70, 7, 9]]}
    for step_prompts in prompts.values():
        for prompt in step_prompts:
            ids = torch.tensor([prompt], device=DEVICE)
            unmasked = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False)
            assert 0 not in prompt or not torch.equal(target.generate(ids, max_new_tokens=10, do_sample=False),
                                                      unmasked)  # the inferred mask matters: the test can fail
    arrivals = {step: [(p, dict(max_new_tokens=10, do_sample=False)) for p in ps] for step, ps in prompts.items()}
    requests, streamed = run_arrivals(decoder, arrivals)
    for request_id, (prompt, _) in requests.items():
        ids = torch.tensor([prompt], device=DEVICE)
        expected = target.generate(ids, max_new_tokens=10, do_sample=False)[0, len(prompt):]
        assert decoder.result(request_id).token_ids == expected.tolist(), prompt
    with pytest.raises(ValueError, match="ends with pad_token_id=0"):
        decoder.add_request([5, 6, 0], max_new_tokens=4)


def test_a_model_default_of_several_sequences_is_refused_by_add_request():
    """A model whose generation_config asks for num_return_sequences > 1 (with sampling): add_request accepted the
    request, and the step that admitted it raised HF's greedy-with-several-sequences error, again at every later
    step (the request stayed queued): the decoder was stuck. add_request now refuses it by name, and the batch is
    built for one sequence per request whatever the model's default."""
    target, draft = llama().to(DEVICE), llama(layers=1, seed=2).to(DEVICE)
    target.generation_config.do_sample, target.generation_config.num_return_sequences = True, 2
    decoder = sk.SpeculativeDecoder(target, draft, num_speculative_tokens=GAMMA)
    with pytest.raises(ValueError, match=r"num_return_sequences=2 \(from the model's generation config\)"):
        decoder.add_request([5, 6, 7], max_new_tokens=4)
    assert not decoder.has_work()


def test_a_prompt_with_a_masked_token_inside_a_short_span_joins_longer_prompts_on_a_sliding_window_model():
    """On a sliding-window model a prompt holding the pad id (masked, as HF masks it) is refused only when the request
    could span a window (HF counts the masked slot, the caches do not); a shorter one is exact and accepted. The step
    admitting it with a longer prompt checked the joined batch as one request spanning the longest prompt, raised,
    and raised again at every later step (the requests stayed queued, the running one starved). Each row is now
    checked over its own span, as add_request checked it: every request is model.generate on it alone."""
    from helpers.models import more_families

    make = more_families()["mistral"]  # window 4
    target, draft = make().to(DEVICE), make(layers=1, seed=3).to(DEVICE)
    decoder = sk.SpeculativeDecoder(target, draft, num_speculative_tokens=GAMMA)
    arrivals = {0: [([5, 6, 7], dict(max_new_tokens=8, do_sample=False))],
                1: [([3, 0, 4], dict(max_new_tokens=1, do_sample=False)),
                    (list(range(5, 15)), dict(max_new_tokens=5, do_sample=False))]}
    with pytest.raises(ValueError, match="sliding-window"):  # the same prompt with a longer span: refused up front
        decoder.add_request([3, 0, 4], max_new_tokens=3)
    requests, streamed = run_arrivals(decoder, arrivals)
    for request_id, (prompt, request_settings) in requests.items():
        expected = target.generate(torch.tensor([prompt], device=DEVICE), **request_settings)[0, len(prompt):]
        assert decoder.result(request_id).token_ids == streamed[request_id] == expected.tolist(), prompt


def test_a_drafter_without_add_rows_is_refused_by_the_first_add_request(pair):
    """A Drafter written for generate()/start() only, without add_rows: add_request accepted requests, and the first
    merge of a joining request raised AttributeError midway (masks and processors already joined), which cancelled
    every running request too. The first add_request now refuses the decoder's drafter by name, and a merge checks
    for it before changing anything."""
    target, _ = pair

    class SessionsOnly:  # every Drafter method but add_rows
        def __init__(self):
            self.inner = sk.NGramDrafter.for_model(target)

        def __getattr__(self, name):
            if name == "add_rows":
                raise AttributeError(name)
            return getattr(self.inner, name)

    decoder = sk.SpeculativeDecoder(target, drafter=SessionsOnly, num_speculative_tokens=GAMMA)
    with pytest.raises(ValueError, match="add_request needs a drafter with add_rows.*SessionsOnly has none"):
        decoder.add_request([5, 6, 7], max_new_tokens=4, do_sample=False)
    assert not decoder.has_work()
    with torch.inference_mode():
        running, joining = (_row_loop((target, None), prompt, drafter=SessionsOnly())
                            for prompt in ([5, 6, 7], [9, 10]))
        with pytest.raises(ValueError, match=r"the drafter \(SessionsOnly\) has no add_rows"):
            running.append_rows(joining)
        assert running.batch == 1


def test_a_step_that_raises_midway_ends_its_batch_and_the_decoder_goes_on(pair, monkeypatch):
    """A forward raising inside a step (out of memory) left the running requests running on half-updated caches: a
    caller stepping on got other tokens than the request alone (silently) or size-mismatch errors inside
    transformers for ever. Now they finish with finish_reason "error" and the tokens they had; the decoder serves
    requests added afterwards exactly. The same when removing a finished row fails (an allocation in keep_rows):
    it kept its row, and after release() every step raised a KeyError."""
    from speculative_kernels.generation.loop import SpeculativeLoop

    target, draft = pair
    decoder = sk.SpeculativeDecoder(target, draft, num_speculative_tokens=GAMMA)
    first = [decoder.add_request([5, 6, 7], max_new_tokens=30, do_sample=False),
             decoder.add_request([9, 10], max_new_tokens=30, do_sample=True, seed=2)]
    decoder.step()
    decoder.step()
    calls = {"n": 0}

    def out_of_memory(module, args, output):
        calls["n"] += 1
        if calls["n"] == 2:  # the second target forward of the step: after the first wrote to the caches
            raise torch.OutOfMemoryError("simulated")

    handle = target.model.layers[0].register_forward_hook(sk.per_token_hook(out_of_memory))
    try:
        with pytest.raises(torch.OutOfMemoryError):
            while True:
                decoder.step()
    finally:
        handle.remove()
    for request_id in first:
        result = decoder.result(request_id)
        assert result.finish_reason == "error" and result.error == "OutOfMemoryError: simulated"
    assert decoder.running == [] and not decoder.has_work()
    greedy = dict(max_new_tokens=12, do_sample=False)
    later = decoder.add_request([5, 6, 7], **greedy)
    while decoder.has_work():
        decoder.step()
    assert decoder.result(later).token_ids == _alone(pair, [5, 6, 7], greedy)

    # a finished row whose removal fails
    short = decoder.add_request([5, 6, 7], max_new_tokens=2, do_sample=False)
    long = decoder.add_request([9, 10], max_new_tokens=30, do_sample=False)
    decoder.step()

    def no_room(self, rows):
        raise MemoryError("no room to compact")

    with monkeypatch.context() as patch:
        patch.setattr(SpeculativeLoop, "keep_rows", no_room)
        with pytest.raises(MemoryError):
            while True:
                decoder.step()
    assert decoder.result(short).finish_reason == "length"
    assert decoder.result(long).finish_reason == "error" and decoder.running == []
    for request_id in (short, long):
        decoder.release(request_id)
    again = decoder.add_request([5, 6, 7], **greedy)
    while decoder.has_work():
        decoder.step()
    assert decoder.result(again).token_ids == _alone(pair, [5, 6, 7], greedy)


def test_request_settings_beyond_the_batchs_tensors(pair):
    """A batch holds each request's temperature in float32 and top_k / min_new_tokens in int64: temperature=1e39,
    top_k=2**63 and min_new_tokens=10**30 were accepted by add_request and failed at the admitting step ('must be
    finite ... inf', 'Overflow when unpacking long long'). The temperature is refused by name up front; top_k past
    the vocabulary (no cut) and min_new_tokens past max_new_tokens (EOS masked to the end) decode as the request
    alone."""
    target, draft = pair
    decoder = sk.SpeculativeDecoder(target, draft, num_speculative_tokens=GAMMA)
    with pytest.raises(ValueError, match=r"temperature=1e\+39 exceeds float32's largest value"):
        decoder.add_request([5, 6], max_new_tokens=3, do_sample=True, temperature=1e39)
    settings = [dict(max_new_tokens=6, do_sample=True, top_k=2**63, seed=1),
                dict(max_new_tokens=6, do_sample=False, min_new_tokens=10**30)]
    requests = [decoder.add_request([5, 6], **s) for s in settings]
    while decoder.has_work():
        decoder.step()
    for request_id, s in zip(requests, settings):
        result = decoder.result(request_id)
        assert result.finish_reason == "length" and result.token_ids == _alone(pair, [5, 6], s)


def test_a_joining_request_whose_first_tokens_fail_is_ended_not_lost(pair, monkeypatch):
    """Collecting the joining requests' first tokens raised after they had left the queue: they were neither queued,
    running nor finished (has_work() False, release() refused them). They now end with finish_reason "error"; the
    running request goes on, exact."""
    from speculative_kernels import continuous

    target, draft = pair
    decoder = sk.SpeculativeDecoder(target, draft, num_speculative_tokens=GAMMA)
    running = decoder.add_request([5, 6, 7], max_new_tokens=12, do_sample=False)
    decoder.step()
    joining = decoder.add_request([9, 10, 11], max_new_tokens=6, do_sample=False)
    real = continuous.ContinuousBatcher._collect

    def failing(self, loop, rows):
        if joining in rows and running not in rows:
            raise RuntimeError("collecting failed")
        return real(self, loop, rows)

    monkeypatch.setattr(continuous.ContinuousBatcher, "_collect", failing)
    with pytest.raises(RuntimeError, match="collecting failed"):
        decoder.step()
    result = decoder.result(joining)
    assert result.finish_reason == "error" and result.error == "RuntimeError: collecting failed"
    decoder.release(joining)
    while decoder.has_work():
        decoder.step()
    assert decoder.result(running).token_ids == _alone(pair, [5, 6, 7], dict(max_new_tokens=12, do_sample=False))


@pytest.mark.parametrize("call", ["step", "cancel"])
def test_a_step_or_cancel_from_inside_a_step_is_refused_by_name(pair, call):
    """A callback running inside step() (a forward hook, here) that calls step() again ran a nested iteration, and
    one that cancels a running request changed the batch mid-iteration: torch then failed on mismatched sizes and
    every running request ended with that error. Both are refused by name now (the step fails as any step that
    raises midway); between steps they work as before."""
    target, draft = pair
    decoder = sk.SpeculativeDecoder(target, draft, num_speculative_tokens=GAMMA)
    first = decoder.add_request([5, 6, 7], max_new_tokens=10, do_sample=False)
    second = decoder.add_request([8, 9], max_new_tokens=10, do_sample=False)
    decoder.step()
    decoder.step()
    calls = []

    def reenter(module, args, output):
        if not calls:
            calls.append(1)
            decoder.step() if call == "step" else decoder.cancel(second)

    handle = target.model.layers[0].register_forward_hook(sk.per_token_hook(reenter))
    try:
        with pytest.raises(RuntimeError, match="step\\(\\) is already running" if call == "step" else
                           "cannot cancel request .* from inside a running step\\(\\)"):
            decoder.step()
    finally:
        handle.remove()
    assert not decoder.has_work() and {decoder.result(r).finish_reason for r in (first, second)} == {"error"}
    later = decoder.add_request([5, 6, 7], max_new_tokens=10, do_sample=False)
    other = decoder.add_request([8, 9], max_new_tokens=10, do_sample=False)
    decoder.step()
    assert decoder.cancel(other)  # (between steps)
    while decoder.has_work():
        decoder.step()
    assert decoder.result(later).token_ids == _alone(pair, [5, 6, 7], dict(max_new_tokens=10))


def test_other_threads_calls_wait_for_the_running_step(pair):
    """A server's handler threads call cancel, add_request and result while its engine thread is inside step().
    Such a cancel was refused as if it came from a callback (or, one instant earlier, raced the step and changed
    the batch mid-iteration). The decoder's methods hold one lock: the other thread's calls wait for the step to
    end and run between two steps; outputs are each request's alone."""
    import threading

    target, draft = pair
    decoder = sk.SpeculativeDecoder(target, draft, num_speculative_tokens=GAMMA)
    first = decoder.add_request([5, 6, 7], max_new_tokens=10, do_sample=False)
    second = decoder.add_request([8, 9], max_new_tokens=10, do_sample=False)
    decoder.step()
    inside, go_on = threading.Event(), threading.Event()

    def hold(module, args, output):  # the engine thread's step, held inside its target forward
        if not inside.is_set():
            inside.set()
            assert go_on.wait(30)

    other = {}

    def handler():  # another thread, while the step is held
        assert inside.wait(30)
        other["cancelled"] = decoder.cancel(second)
        other["added"] = decoder.add_request([11, 12, 13], max_new_tokens=6, do_sample=False)
        other["result"] = decoder.result(first)

    handle = target.model.layers[0].register_forward_hook(sk.per_token_hook(hold))
    thread = threading.Thread(target=handler)
    try:
        thread.start()
        stepping = threading.Thread(target=decoder.step)
        stepping.start()
        assert inside.wait(30)
        thread.join(timeout=0.3)
        assert thread.is_alive() and not other  # waits for the step
        go_on.set()
        stepping.join(30)
        thread.join(30)
    finally:
        go_on.set()
        handle.remove()
    assert other["cancelled"] and decoder.result(second).finish_reason == "cancelled"
    assert other["result"].finish_reason is None and len(other["result"].token_ids) > 1  # read after the step
    while decoder.has_work():
        decoder.step()
    assert decoder.result(first).token_ids == _alone(pair, [5, 6, 7], dict(max_new_tokens=10, do_sample=False))
    assert decoder.result(other["added"]).token_ids == _alone(pair, [11, 12, 13], dict(max_new_tokens=6,
                                                                                        do_sample=False))


def test_a_request_that_fails_alone_beside_prompt_lookup(pair):
    """A request whose own logits leave no token (every id suppressed) fails alone. With a drafter whose counts
    ride the iteration's read (prompt lookup), the loop's failure branch reused the batch size's name for its row
    index: the counts were read one row short and every request of the batch ended with an IndexError."""
    target, _ = pair
    decoder = sk.SpeculativeDecoder(target, num_speculative_tokens=3, prompt_lookup_num_tokens=3)
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]
    good = decoder.add_request(prompt, max_new_tokens=12, do_sample=False, eos_token_id=None)
    bad = decoder.add_request([9, 10, 11, 9, 10, 11], max_new_tokens=10, do_sample=True, eos_token_id=None,
                              suppress_tokens=list(range(target.config.vocab_size)))
    while decoder.has_work():
        decoder.step()
    assert decoder.result(bad).finish_reason == "error"
    assert decoder.result(good).token_ids == target.generate(torch.tensor([prompt], device=DEVICE), max_new_tokens=12,
                                                             do_sample=False, eos_token_id=None)[0, 8:].tolist()


@pytest.mark.parametrize("refusal", [ValueError, NotImplementedError])
def test_a_drafter_that_refuses_a_merge_leaves_the_running_batch_as_it_was(pair, refusal):
    """A drafter's add_rows refusing (ValueError / NotImplementedError: the protocol's way) came after the running
    loop had joined the joining rows' masks, processors and context starts: the next request to join took the
    refused one's row state and its repetition_penalty, and gave other tokens than model.generate (silently), or the
    running request died a step later with a shape error (min_new_tokens). The drafter now joins first; the refused
    request finishes with "error" naming why (it was "cancelled", which no one asked for), and step() goes on."""
    from speculative_kernels.generation.lookup_drafter import PromptLookupDrafter

    target, _ = pair
    refuse = {"on": False}

    class Picky(PromptLookupDrafter):
        def add_rows(self, other):
            if refuse["on"]:
                raise refusal("Picky cannot take these rows")
            super().add_rows(other)

    decoder = sk.SpeculativeDecoder(target, drafter=lambda: Picky(3, 2), num_speculative_tokens=GAMMA)
    greedy = dict(max_new_tokens=16, do_sample=False)
    first = decoder.add_request([5, 6, 7], **greedy)
    decoder.step()
    refused = decoder.add_request([9, 10, 11], max_new_tokens=16, do_sample=False, repetition_penalty=50.0,
                                  min_new_tokens=10)
    refuse["on"] = True
    decoder.step()  # the refused request's own first iteration, then the refused merge
    refuse["on"] = False
    result = decoder.result(refused)
    assert result.finish_reason == "error" and "Picky cannot take these rows" in result.error
    assert decoder.running == [first]
    later = decoder.add_request([20, 21, 22], **greedy)
    while decoder.has_work():
        decoder.step()
    for request_id, prompt in ((first, [5, 6, 7]), (later, [20, 21, 22])):
        expected = target.generate(torch.tensor([prompt], device=DEVICE), **greedy)[0, len(prompt):]
        assert decoder.result(request_id).token_ids == expected.tolist()


def test_request_ids_are_ints_not_bools(pair):
    """decoder.result(True) / cancel(True) / release(True) acted on request 1 (True == 1 as a dict key); a NumPy
    integer naming an existing request was 'unknown'; releasing a queued request said it was running."""
    target, draft = pair
    decoder = sk.SpeculativeDecoder(target, draft, num_speculative_tokens=GAMMA)
    ids = [decoder.add_request([5, 6, 7], max_new_tokens=4, do_sample=False) for _ in range(2)]
    assert ids[1] == 1
    for method in (decoder.result, decoder.cancel, decoder.release):
        with pytest.raises(TypeError, match="request_id must be an int"):
            method(True)
    with pytest.raises(TypeError, match="request_id must be an int"):
        decoder.result("1")
    assert decoder.result(np.int64(1)).prompt_ids == [5, 6, 7]
    with pytest.raises(ValueError, match="request 1 is still queued; cancel it first"):
        decoder.release(1)
    assert decoder.cancel(np.int64(1)) and decoder.result(1).finish_reason == "cancelled"
    decoder.release(np.int64(1))
    with pytest.raises(ValueError, match="unknown request_id 1"):
        decoder.result(1)


def test_a_batch_of_greedy_requests_runs_the_greedy_ops(pair, monkeypatch):
    """While every running request is greedy, the steps run the greedy verification and draft argmax (the sampling
    ops gave greedy rows the same tokens after a sort of every row's logits: ~3x the CPU time per step); a sampled
    request joining switches the batch to the per-row ops, and its leaving switches it back. Tokens: each alone."""
    from speculative_kernels.ops import reference

    warped = []
    original = reference._warped_probs
    monkeypatch.setattr(reference, "_warped_probs", lambda *a, **k: (warped.append(1), original(*a, **k))[1])
    target, draft = pair
    decoder = sk.SpeculativeDecoder(target, draft, num_speculative_tokens=GAMMA, backend="torch")
    greedy = {0: [([5, 6, 7, 8], dict(max_new_tokens=12, do_sample=False)), ([9, 10], dict(max_new_tokens=9))]}
    counts = []
    requests, _ = run_arrivals(decoder, greedy, each_step=lambda d: counts.append(len(warped)))
    assert warped == []
    sampled = {**greedy, 1: [([11, 12, 13], dict(max_new_tokens=3, do_sample=True, seed=1))]}
    counts = []
    requests, _ = run_arrivals(decoder, sampled, each_step=lambda d: counts.append(len(warped)))
    assert 0 < counts[-1] and counts[-1] == counts[-2]  # (the sampled request's steps only, then greedy again)
    for request_id, (prompt, settings) in requests.items():
        assert decoder.result(request_id).token_ids == _alone(pair, prompt, settings)


@pytest.mark.parametrize("drafting", ["draft model", "prompt lookup"])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_a_gamma_far_above_any_requests_length_is_sized_by_what_the_rows_can_draft(pair, cache, drafting):
    """num_speculative_tokens (or prompt_lookup_num_tokens) = 10**10 (HF caps each iteration at the tokens left, and
    so do we): nothing is sized for it (torch's allocator failed every request; the static cache's memory check
    blamed max_context), and rows that may draft more than the running batch's (a longer request joining short ones)
    widen it: each request's output is its output alone, sampled ones with that gamma too (a request's drafts
    follow its own tokens left)."""
    target, draft = pair
    static = dict(cache_implementation="static", max_context=40) if cache == "static" else {}
    if drafting == "draft model":
        decoder = sk.SpeculativeDecoder(target, draft, num_speculative_tokens=10**10, max_batch_size=4, **static)
    else:
        decoder = sk.SpeculativeDecoder(target, prompt_lookup_num_tokens=10**10, max_batch_size=4, **static)
    arrivals = {0: [([5, 6, 7, 5, 6], dict(max_new_tokens=3, do_sample=True, temperature=0.9, seed=11)),
                    ([8, 9], dict(max_new_tokens=2, do_sample=False))],
                1: [([10, 11, 12, 10, 11], dict(max_new_tokens=14, do_sample=True, top_k=6, seed=12)),
                    ([14], dict(max_new_tokens=9, do_sample=False))]}
    requests, streamed = run_arrivals(decoder, arrivals)
    for request_id, (prompt, settings) in requests.items():
        result = decoder.result(request_id)
        assert result.finish_reason == "length", result.error
        if drafting == "draft model":
            want = alone(target, draft, prompt, settings, 10**10, DEVICE)
        else:
            ids = torch.tensor([prompt], device=DEVICE)
            want = sk.generate(target, ids, prompt_lookup_num_tokens=10**10, pad_token_id=0,
                               **settings)[0, len(prompt):].tolist()
        assert streamed[request_id] == result.token_ids == want


def test_rows_that_accepted_every_draft_feed_their_last_draft_beside_rows_that_did_not():
    """An iteration where some rows accept all their drafts and others stop short (a row near its own end): each
    all-accepted row's draft model must take its last draft as a pending input. Greedy tokens cannot show a wrong
    draft context; with the target as its own draft every draft is accepted only if the context is right, and a
    seeded sampled request must equal the same request alone."""
    target = llama()
    prompts, news = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [20, 21, 22, 23]], [40, 6, 9]

    def run(requests, settings):
        decoder = sk.SpeculativeDecoder(target, target, num_speculative_tokens=4, max_batch_size=4)
        ids = [decoder.add_request(p, max_new_tokens=n, eos_token_id=None, **settings(i)) for i, p, n in requests]
        while decoder.has_work():
            decoder.step()
        return [decoder.result(r) for r in ids]

    for result in run([(i, p, n) for i, (p, n) in enumerate(zip(prompts, news))], settings=lambda i: {}):
        assert result.drafted_tokens > 0 and result.accepted_tokens == result.drafted_tokens
    sampled = lambda i: dict(do_sample=True, temperature=1.0, seed=7 + i)  # noqa: E731
    together = run([(i, p, n) for i, (p, n) in enumerate(zip(prompts, news))], settings=sampled)
    assert together[0].token_ids == run([(0, prompts[0], news[0])], settings=sampled)[0].token_ids


def test_a_requests_accepted_tokens_count_what_it_kept_when_eos_cuts_a_block():
    """The target as its own draft accepts every draft, so each step emits what it kept plus one token: when EOS
    falls inside an accepted block the drafts after it are not kept, and accepted_tokens = tokens - iterations."""
    target = llama()
    prompt = [5, 6, 7, 8, 9, 10]
    plain = target.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, eos_token_id=None,
                            pad_token_id=0)[0, len(prompt):].tolist()
    at = next(j for j in range(3, len(plain)) if plain[j] not in plain[:j])  # its first occurrence, past block 1
    decoder = sk.SpeculativeDecoder(target, target, num_speculative_tokens=4)
    request = decoder.add_request(prompt, max_new_tokens=20, eos_token_id=plain[at])
    while decoder.has_work():
        decoder.step()
    result = decoder.result(request)
    assert result.finish_reason == "eos" and result.token_ids == plain[: at + 1]
    assert result.accepted_tokens == len(result.token_ids) - result.iterations


def test_admission_counts_the_running_rows_against_max_batch_size():
    """One of two rows finishes while two requests wait: only one may join (max_batch_size caps running rows)."""
    target, draft = llama(), llama(layers=1, seed=3)
    d = sk.SpeculativeDecoder(target, draft, num_speculative_tokens=3, max_batch_size=2)
    for n in (3, 30):
        d.add_request([5, 6, 7, 8], max_new_tokens=n, eos_token_id=None)
    d.step()
    for _ in range(2):
        d.add_request([9, 10, 11], max_new_tokens=30, eos_token_id=None)
    while d.has_work():
        d.step()
        assert len(d.running) <= 2


def test_row_settings_carry_a_host_bound_of_top_k_kept_by_row_selection_and_joins():
    """``RowSettings.sampling`` bounds the sampled rows' top_k when every sampled row with top_p < 1 has one (a
    greedy row's top_p does not count); a row with top_p and no top_k leaves no bound (its cut needs the whole
    vocabulary). Selecting rows keeps the bound, joining takes the larger, or none if either has none."""
    from speculative_kernels.generation.row_settings import RowSettings

    def rows(temperature, top_k, top_p):
        n = len(top_k)
        return RowSettings(max_new_tokens=[4] * n, eos=[frozenset()] * n, temperature=temperature, top_k=top_k,
                           top_p=top_p, min_new_tokens=[0] * n, keys=[1] * n, draft_offsets=[0] * n,
                           verify_offsets=[0] * n).sampling(torch.device(DEVICE)).rows

    bounded = rows([0.0, 0.7, 1.0], [0, 5, 7], [0.5, 0.9, 1.0])
    assert bounded.top_k_bound == 7
    assert rows([0.7, 1.0], [5, 0], [0.9, 0.9]).top_k_bound is None
    assert rows([0.7, 1.0], [0, 0], [1.0, 1.0]).top_k_bound == 0
    assert bounded.select(torch.tensor([1], device=DEVICE)).top_k_bound == 7
    assert bounded.join(rows([1.0], [30], [0.8])).top_k_bound == 30
    assert bounded.join(rows([1.0], [0], [0.8])).top_k_bound is None


def test_per_row_cut_takes_the_host_bound_when_rows_join(pair, monkeypatch):
    """Sampled requests with top-k and top-p (each its own k) joining at different steps: the per-row cut gets the
    rows' bound (one topk instead of a sort per row) and each request still matches itself alone. The bound is
    recorded where the decoder makes the rows' ``Sampling`` (every backend) and, on the CPU, where the reference's cut
    takes it (a GPU runs the CUDA backend: the seventh GPU run found this test recording only the reference)."""
    from speculative_kernels.generation.row_settings import RowSettings
    from speculative_kernels.ops import reference, warping

    bounds, cut_bounds = [], []
    real_sampling, real_thresholds = RowSettings.sampling, warping.row_thresholds

    def sampling(self, device):
        made = real_sampling(self, device)
        bounds.append(made.rows.top_k_bound)
        return made

    def thresholds(z, top_k, top_p, top_k_bound=None):
        cut_bounds.append(top_k_bound)
        return real_thresholds(z, top_k, top_p, top_k_bound)

    monkeypatch.setattr(RowSettings, "sampling", sampling)
    monkeypatch.setattr(reference, "row_thresholds", thresholds)
    decoder = sk.SpeculativeDecoder(*pair, num_speculative_tokens=GAMMA)
    arrivals = {0: [([5, 6, 7], dict(max_new_tokens=6, do_sample=True, top_k=5, top_p=0.9, seed=1))],
                2: [([9, 10], dict(max_new_tokens=6, do_sample=True, top_k=20, top_p=0.7, seed=2))]}
    requests, _ = run_arrivals(decoder, arrivals)
    assert 20 in bounds and None not in bounds  # (the joined batch's: before the requests alone run)
    if DEVICE == "cpu":
        assert 20 in cut_bounds and None not in cut_bounds
    for request_id, (prompt, settings) in requests.items():
        assert decoder.result(request_id).token_ids == _alone(pair, prompt, settings), settings
