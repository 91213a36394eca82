"""Continuous batching on the static cache: ``SpeculativeDecoder(..., cache_implementation="static",
max_context=N)`` allocates K/V for ``max_batch_size`` rows of ``max_context`` (plus slack) once; rows leave by moving
to the front in place and join by being copied into the free rows at the shared write pointer (holes on the left of
the shorter side). Each request's output is still its own alone: greedy ones ``model.generate``, seeded sampled ones
``speculative_kernels.generate`` with the same seed."""

import re

import pytest
import torch

import speculative_kernels as sk
from helpers.continuous import run_arrivals
from helpers.host_reads import count_reads_per_loop_step
from helpers.models import gpt2, llama
from speculative_kernels.generation.runners.static_decoder import StaticDecoderRunner

# CUDA when there is one (gpu.py runs these files there: continuous batching on the GPU), else the CPU.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
GAMMA = 3
LONG = [(7 * i) % 90 + 3 for i in range(28)]


@pytest.fixture(scope="module")
def pair():
    return llama().to(DEVICE), llama(layers=1, seed=2).to(DEVICE)


@pytest.fixture(scope="module")
def gpt2_pair():
    """GPT-2's learned absolute positions make a row's tokens depend on its positions far more than a small random
    Llama's rotary ones do: a row given another row's positions changes its tokens."""
    return gpt2().to(DEVICE), gpt2(layers=1, seed=2).to(DEVICE)


def _alone(target, prompt, settings, **drafting):
    """The request decoded alone: model.generate when greedy, else speculative_kernels.generate with its seed."""
    ids = torch.tensor([prompt], device=DEVICE)
    if not settings.get("do_sample"):
        return target.generate(ids, pad_token_id=0, **settings)[0, len(prompt):].tolist()
    return sk.generate(target, ids, pad_token_id=0, **drafting, **settings)[0, len(prompt):].tolist()


def _runners(decoder):
    loop = decoder._batcher._loop
    if loop is None:
        return []
    drafter_runner = getattr(loop.drafter, "runner", None)
    return [loop.target_runner] + ([drafter_runner] if drafter_runner is not None else [])


ARRIVALS = {
    0: [([5, 6, 7], dict(max_new_tokens=30, do_sample=False)),
        ([8, 9, 8, 9], dict(max_new_tokens=5, do_sample=True, temperature=0.9, seed=11))],
    # longer than the running rows' slots: the running rows move right (holes on their left)
    2: [(LONG, dict(max_new_tokens=14, do_sample=False)),
        (LONG[:20], dict(max_new_tokens=9, do_sample=True, top_k=6, seed=12))],
    # greedy only: their first token comes from the target's forward over the prompts (nothing drafted)
    4: [([6, 7, 6, 7, 6, 7, 6], dict(max_new_tokens=9, do_sample=False))],
    # shorter: the joining rows get holes on their left
    7: [([4, 2], dict(max_new_tokens=8, do_sample=True, temperature=1.2, seed=13)),
        ([3], dict(max_new_tokens=6, do_sample=False))],
    # finished by their first iteration (never join), and one that joins with one token left
    8: [([10, 11, 12], dict(max_new_tokens=1, do_sample=True, seed=14)),
        ([13, 14], dict(max_new_tokens=1, do_sample=False)),
        ([15, 16, 17], dict(max_new_tokens=2, do_sample=False))],
}


@pytest.mark.parametrize("family, kind", [("llama", "draft model"), ("llama", "prompt lookup"),
                                          ("gpt2", "draft model")])
def test_static_requests_joining_and_leaving_match_each_request_alone(request, family, kind, monkeypatch):
    """Requests with their own settings join (longer and shorter than the running rows, both merge paths are
    exercised) and leave (from the middle of the batch too) a static batch of at most 4 rows: each one's streamed
    tokens are its output alone; the K/V buffers are allocated once for 4 rows (the same storage at every step) and
    the batch uses their first rows."""
    target, draft = request.getfixturevalue("pair" if family == "llama" else "gpt2_pair")
    if kind == "draft model":
        decoder_kwargs = dict(draft=draft, num_speculative_tokens=GAMMA)
        alone_kwargs = dict(draft_model=draft, num_speculative_tokens=GAMMA)
    else:
        decoder_kwargs = alone_kwargs = dict(prompt_lookup_num_tokens=GAMMA)
    shifts = []
    shift_right = StaticDecoderRunner._shift_right

    def spied(runner, shift):
        shifts.append(shift)
        return shift_right(runner, shift)

    monkeypatch.setattr(StaticDecoderRunner, "_shift_right", spied)
    decoder = sk.SpeculativeDecoder(target, max_batch_size=4, cache_implementation="static", max_context=64,
                                    **decoder_kwargs)
    storage = {}

    def check(decoder):
        for runner in _runners(decoder):
            buffers = runner.cache.buffers()
            assert all(t.shape[0] == 4 for t in buffers) and runner.rows == 4
            assert runner.cache.layers[0].keys.shape[0] == runner.slot_mask.shape[0] == decoder._batcher._loop.batch
            pointers = [t.data_ptr() for t in buffers]
            assert storage.setdefault(id(runner), pointers) == pointers  # allocated once
            assert runner.num_slots + runner.reserve <= runner.capacity

    requests, streamed = run_arrivals(decoder, ARRIVALS, check)
    assert any(s > 0 for s in shifts) and any(s == 0 for s in shifts)  # both merge paths ran
    for request_id, (prompt, settings) in requests.items():
        expected = _alone(target, prompt, settings, **alone_kwargs)
        assert streamed[request_id] == expected, (prompt, settings)
        assert decoder.result(request_id).token_ids == expected


def test_static_memory_stays_bounded_over_many_admissions_and_cancellations(pair):
    """Sixty requests admitted and cancelled, while a long-running request is replaced before it ends (so the batch
    never empties): the caches keep their allocation and their write pointer within capacity (holes squeezed out),
    the loop's output buffers do not grow with the number of requests served, and a request served at the end is
    still model.generate's."""
    target, draft = pair
    decoder = sk.SpeculativeDecoder(target, draft, num_speculative_tokens=GAMMA, max_batch_size=3,
                                    cache_implementation="static", max_context=48)
    anchor = decoder.add_request([5, 6, 7], max_new_tokens=40, do_sample=False)
    decoder.step()
    runner = decoder._batcher._loop.target_runner
    pointers = [t.data_ptr() for t in runner.cache.buffers()]
    widths, replaced = [], 0
    for i in range(60):
        other = decoder.add_request([(3 * i + j) % 90 + 3 for j in range(2 + i % 20)], max_new_tokens=20,
                                    do_sample=bool(i % 2), seed=i)
        decoder.step()
        decoder.step()
        decoder.cancel(other)
        if len(decoder.result(anchor).token_ids) >= 25:  # at most 3 steps of 4 tokens before the next check
            new = decoder.add_request([5, 6, 7], max_new_tokens=40, do_sample=False)
            decoder.step()
            decoder.cancel(anchor)
            anchor, replaced = new, replaced + 1
        loop = decoder._batcher._loop
        assert loop.target_runner is runner and [t.data_ptr() for t in runner.cache.buffers()] == pointers
        assert runner.num_slots <= runner.capacity
        widths.append(loop.sequences.shape[1])
    assert replaced >= 2
    # the longest prompt (21) + the most new tokens (40) + one iteration's scatter slack
    assert max(widths) <= 21 + 40 + GAMMA + 1
    last = decoder.add_request(LONG[:12], max_new_tokens=10, do_sample=False)
    while decoder.has_work():
        decoder.step()
    assert decoder.result(last).token_ids == _alone(target, LONG[:12], dict(max_new_tokens=10))


def test_static_one_host_read_per_iteration_after_rows_join(pair, monkeypatch):
    """Iterations of a static batch that rows have joined and left still read the device once."""
    reads = count_reads_per_loop_step(monkeypatch)
    decoder = sk.SpeculativeDecoder(*pair, num_speculative_tokens=GAMMA, max_batch_size=4,
                                    cache_implementation="static", max_context=40)
    arrivals = {0: [([5, 6, 7], dict(max_new_tokens=20, do_sample=False))],
                2: [(list(range(3, 25)), dict(max_new_tokens=10, do_sample=True, min_new_tokens=4, seed=1))],
                4: [([9, 10], dict(max_new_tokens=6, do_sample=True, top_p=0.8, seed=2))]}
    run_arrivals(decoder, arrivals)
    assert len(reads) > 5 and all(r == ["tolist"] for r in reads), reads


def test_static_caches_are_checked_against_free_memory_before_admission(pair):
    """Caches the device cannot hold are refused with MemoryError naming their size before anything is
    allocated: with nothing running, the request finishes with finish_reason "error" and that reason."""
    decoder = sk.SpeculativeDecoder(*pair, num_speculative_tokens=GAMMA, max_batch_size=16,
                                    cache_implementation="static", max_context=10**9)
    request = decoder.add_request([5, 6, 7], max_new_tokens=4, do_sample=False)
    assert decoder.step() == {}
    result = decoder.result(request)
    assert result.finish_reason == "error" and re.match(r"MemoryError: .*16 rows", result.error), result.error
    assert decoder.queued == [] and decoder.running == [] and not decoder.has_work()


@pytest.mark.parametrize("kwargs, message", [
    (dict(cache_implementation="static"), "max_context"),
    (dict(cache_implementation="static", max_context=1), "max_context"),
    (dict(cache_implementation="static", max_context=True), "max_context"),
    (dict(max_context=64), "max_context sizes the static cache"),
    (dict(cache_implementation="paged"), "cache_implementation"),
    (dict(cache_implementation="static", max_context=64, num_speculative_tokens="auto"), "fixed num_speculative"),
])
def test_bad_static_settings_are_refused_by_name(pair, kwargs, message):
    kwargs = {"num_speculative_tokens": GAMMA, **kwargs}
    with pytest.raises(ValueError, match=message):
        sk.SpeculativeDecoder(*pair, **kwargs)


def test_a_request_longer_than_max_context_and_compile_are_refused_by_name(pair):
    decoder = sk.SpeculativeDecoder(*pair, num_speculative_tokens=GAMMA, cache_implementation="static",
                                    max_context=16)
    with pytest.raises(ValueError, match="max_context=16"):
        decoder.add_request(list(range(3, 13)), max_new_tokens=7)
    with pytest.raises(ValueError, match="compile is a setting of the decoder"):
        decoder.add_request(list(range(3, 13)), max_new_tokens=6, compile=True)
    request = decoder.add_request(list(range(3, 13)), max_new_tokens=6, do_sample=False)
    while decoder.has_work():
        decoder.step()
    assert decoder.result(request).token_ids == _alone(pair[0], list(range(3, 13)), dict(max_new_tokens=6))


def test_a_static_batch_that_empties_keeps_its_caches_for_the_next_requests(pair):
    """When every request has left, the loop keeps its static caches with no rows (write pointer back to 0); the
    next requests join them, the same storage, and are still their own outputs alone."""
    target, draft = pair
    decoder = sk.SpeculativeDecoder(target, draft, num_speculative_tokens=GAMMA, max_batch_size=2,
                                    cache_implementation="static", max_context=40)
    first = decoder.add_request(LONG[:10], max_new_tokens=12, do_sample=False)
    decoder.step()
    runners = _runners(decoder)
    pointers = [[t.data_ptr() for t in runner.cache.buffers()] for runner in runners]
    while decoder.has_work():
        decoder.step()
    assert decoder.step() == {} and decoder.running == []
    assert all(runner.num_slots == 0 and runner.slot_mask.shape[0] == 0 for runner in runners)
    second = decoder.add_request([4, 5], max_new_tokens=8, do_sample=True, seed=3)
    third = decoder.add_request(LONG[:6], max_new_tokens=9, do_sample=False)
    while decoder.has_work():
        decoder.step()
        assert _runners(decoder) == runners
    assert [[t.data_ptr() for t in runner.cache.buffers()] for runner in runners] == pointers
    assert decoder.result(first).token_ids == _alone(target, LONG[:10], dict(max_new_tokens=12))
    assert decoder.result(second).token_ids == _alone(
        target, [4, 5], dict(max_new_tokens=8, do_sample=True, seed=3), draft_model=draft,
        num_speculative_tokens=GAMMA)
    assert decoder.result(third).token_ids == _alone(target, LONG[:6], dict(max_new_tokens=9))


def test_a_request_whose_own_cache_does_not_fit_beside_an_idle_batch_frees_it(pair, monkeypatch):
    """An emptied static batch keeps its allocation, and a request joins it through a static cache of its own
    size. Where that second cache does not fit beside the kept allocation (out of memory, here simulated), the idle
    allocation is freed and the request builds the running loop itself, as on a fresh decoder (it was finished
    with "error": a request the decoder could serve alone was refused for the memory its own idle rows held)."""
    import speculative_kernels.continuous as continuous

    target, draft = pair
    decoder = sk.SpeculativeDecoder(target, draft, num_speculative_tokens=GAMMA, max_batch_size=2,
                                    cache_implementation="static", max_context=40)
    first = decoder.add_request(LONG[:10], max_new_tokens=5, do_sample=False)
    while decoder.has_work():
        decoder.step()
    assert decoder._batcher._loop is not None  # idle, with its allocation
    real = continuous.build_loop
    joining_builds = []

    def no_room_beside_it(*args, static_rows=None, cache_implementation=None, **kwargs):
        if cache_implementation == "static" and static_rows is None:  # a joining loop's own static cache
            joining_builds.append(1)
            raise MemoryError("the static caches (1 rows x 30 slots) needs 1 GiB but only 0.5 GiB are free")
        return real(*args, static_rows=static_rows, cache_implementation=cache_implementation, **kwargs)

    monkeypatch.setattr(continuous, "build_loop", no_room_beside_it)
    second = decoder.add_request(LONG[:6], max_new_tokens=9, do_sample=False)
    while decoder.has_work():
        decoder.step()
    assert joining_builds == [1]
    assert decoder.result(second).finish_reason == "length", decoder.result(second).error
    assert decoder.result(second).token_ids == _alone(target, LONG[:6], dict(max_new_tokens=9))
    assert decoder.result(first).token_ids == _alone(target, LONG[:10], dict(max_new_tokens=5))


@pytest.mark.parametrize("drafting", ["draft_model", "prompt_lookup"])
def test_a_first_batch_of_one_token_requests_then_more(pair, drafting):
    """Requests that each make one token run the target alone (the drafter never starts); once they leave, the
    static batch is empty and later requests must still join (this crashed in the drafter's select_rows)."""
    target, draft = pair
    models = (target, draft) if drafting == "draft_model" else (target,)
    extra = {} if drafting == "draft_model" else dict(prompt_lookup_num_tokens=GAMMA)
    decoder = sk.SpeculativeDecoder(*models, num_speculative_tokens=GAMMA, cache_implementation="static",
                                    max_context=48, **extra)
    arrivals = {0: [([5, 6, 7], dict(max_new_tokens=1, do_sample=False)),
                    ([9, 9, 9, 9], dict(max_new_tokens=1, do_sample=True, seed=3))],
                3: [([5, 6, 7, 5, 6], dict(max_new_tokens=12, do_sample=False)),
                    ([8, 9, 8], dict(max_new_tokens=7, do_sample=True, temperature=0.8, seed=4))]}
    requests, streamed = run_arrivals(decoder, arrivals)
    drafting_kwargs = dict(draft_model=draft, num_speculative_tokens=GAMMA) if drafting == "draft_model" else extra
    for request_id, (prompt, settings) in requests.items():
        expected = _alone(target, prompt, settings, **drafting_kwargs)
        assert decoder.result(request_id).token_ids == expected == streamed[request_id], (prompt, settings)


def test_a_static_batch_of_a_model_slicing_a_position_table_by_slots_is_refused_by_add_request():
    """GPT-Neo's global layers slice a causal bias [1, 1, N, N] by the cache's slot count: a static batch whose caches
    hold more slots (max_context plus one iteration and the slack) is refused by add_request, naming max_context
    (each request was accepted, then ended "error" when admitted); one within the table runs as model.generate."""
    from transformers import GPTNeoConfig, GPTNeoForCausalLM

    torch.manual_seed(0)
    neo = GPTNeoForCausalLM(GPTNeoConfig(vocab_size=97, hidden_size=32, num_layers=2, num_heads=4,
                                         max_position_embeddings=32, attention_types=[[["global"], 2]],
                                         bos_token_id=1, eos_token_id=2, pad_token_id=0)).eval().to(DEVICE)
    decoder = sk.SpeculativeDecoder(neo, neo, num_speculative_tokens=2, max_batch_size=2,
                                    cache_implementation="static", max_context=24)
    with pytest.raises(ValueError, match=r"target \(GPTNeoForCausalLM\) slices a table of 32 key positions .*the "
                                         r"decoder's max_context"):
        decoder.add_request([5, 6, 7], max_new_tokens=4, do_sample=False)
    assert decoder.queued == [] and decoder.running == []
    decoder = sk.SpeculativeDecoder(neo, neo, num_speculative_tokens=2, max_batch_size=2,
                                    cache_implementation="static", max_context=16)
    ids = [decoder.add_request(prompt, max_new_tokens=6, do_sample=False, eos_token_id=None)
           for prompt in ([5, 6, 7], [8, 9])]
    while decoder.has_work():
        decoder.step()
    for request_id, prompt in zip(ids, ([5, 6, 7], [8, 9])):
        want = neo.generate(torch.tensor([prompt], device=DEVICE), max_new_tokens=6, do_sample=False,
                            eos_token_id=None, pad_token_id=0)
        assert decoder.result(request_id).token_ids == want[0, len(prompt):].tolist()


def test_a_gamma_past_a_learned_position_table_is_checked_as_the_batch_drafts_it(gpt2_pair):
    """GPT-2's 512 positions, num_speculative_tokens=600: a static batch of max_context 32 never drafts more than 30
    (its caches are sized so), so its requests run as model.generate (every one was refused); a dynamic batch, whose
    joining rows may draft up to 600, is refused with a remedy that can be met (it asked for prompt +
    max_new_tokens <= -87)."""
    target, draft = gpt2_pair
    decoder = sk.SpeculativeDecoder(target, draft, num_speculative_tokens=600, max_batch_size=2,
                                    cache_implementation="static", max_context=32)
    request_id = decoder.add_request([5, 6, 7], max_new_tokens=6, do_sample=False)
    while decoder.has_work():
        decoder.step()
    assert decoder.result(request_id).token_ids == _alone(target, [5, 6, 7], dict(max_new_tokens=6))
    dynamic = sk.SpeculativeDecoder(target, draft, num_speculative_tokens=600)
    with pytest.raises(ValueError, match="learned position table of 512 .*: lower num_speculative_tokens to at most "
                                         "504$"):
        dynamic.add_request([5, 6, 7], max_new_tokens=6, do_sample=False)
