"""Continuous batching with captured steps: ``SpeculativeDecoder(..., cache_implementation="static", max_context=N,
compile=...)``. The running batch's target and draft steps are captured (CUDA graphs on a GPU) for every batch size;
joining requests are prefilled and take their first step eagerly on their own rows, then join in place. Each request
is still its own alone: greedy ones ``model.generate``, seeded sampled ones ``speculative_kernels.generate`` with the
same seed.

CPU: the steps go through dynamo with the ``aot_eager`` backend (the same numerics as eager, fast to build); the two
tests that count graphs use dynamo's ``eager`` backend (the graph count is dynamo's, whatever the backend; no
AOTAutograd trace per graph, about 40% of those tests' time). CUDA
(skipped elsewhere): the default ``compile=True`` (inductor, ``mode="reduce-overhead"``) records CUDA graphs without
skips while rows join and leave."""

import pytest
import torch
from torch._dynamo.utils import counters

import speculative_kernels as sk
from speculative_kernels import CompileOptions
from speculative_kernels.generation.runners import static_decoder
from helpers.continuous import run_arrivals
from helpers.models import llama

ON_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if ON_CUDA else "cpu"
COMPILE = CompileOptions() if ON_CUDA else CompileOptions(backend="aot_eager")
COUNT_GRAPHS = CompileOptions() if ON_CUDA else CompileOptions(backend="eager")  # dynamo's graphs, handed on as traced
GAMMA = 3

ARRIVALS = {
    0: [([5, 6, 7], dict(max_new_tokens=20, do_sample=False)),
        ([8, 9, 8, 9], dict(max_new_tokens=6, do_sample=True, temperature=0.9, seed=11))],
    # longer than the running rows' slots: the running rows move right within their rows
    3: [(list(range(3, 14)), dict(max_new_tokens=12, do_sample=False)),
        ([6, 7, 6, 7, 6, 7], dict(max_new_tokens=7, do_sample=True, top_k=6, seed=12))],
    # after rows have left: shorter ones (holes on their left), one finished by its first step (never joins)
    7: [([4, 2], dict(max_new_tokens=9, do_sample=True, temperature=1.2, seed=13)),
        ([3], dict(max_new_tokens=5, do_sample=False)),
        ([10, 11, 12], dict(max_new_tokens=1, do_sample=False))],
}


@pytest.fixture(scope="module")
def pair():
    return llama().to(DEVICE), llama(layers=1, seed=2).to(DEVICE)


def _alone(target, prompt, settings, drafting):
    ids = torch.tensor([prompt], device=DEVICE)
    if not settings.get("do_sample"):
        return target.generate(ids, pad_token_id=0, **settings)[0, len(prompt):].tolist()
    return sk.generate(target, ids, pad_token_id=0, num_speculative_tokens=GAMMA, **drafting,
                       **settings)[0, len(prompt):].tolist()


def _count_captured_calls(monkeypatch) -> list:
    calls = []
    call = static_decoder.call_captured

    def counted(*args):
        calls.append(args[1].shape)
        return call(*args)

    monkeypatch.setattr(static_decoder, "call_captured", counted)
    return calls


@pytest.mark.parametrize("kind", ["draft model", "prompt lookup"])
def test_compiled_requests_joining_and_leaving_match_each_request_alone(pair, kind, monkeypatch):
    target, draft = pair
    models, drafting = (target, draft), {"draft_model": draft}
    if kind == "prompt lookup":
        models, drafting = (target,), {"prompt_lookup_num_tokens": GAMMA}
    decoder = sk.SpeculativeDecoder(*models, num_speculative_tokens=GAMMA, max_batch_size=4,
                                    cache_implementation="static", max_context=64, compile=COMPILE,
                                    **({} if kind == "draft model" else {"prompt_lookup_num_tokens": GAMMA}))
    calls = _count_captured_calls(monkeypatch)
    counters.clear()
    requests, streamed = run_arrivals(decoder, ARRIVALS)
    for request_id, (prompt, settings) in requests.items():
        result = decoder.result(request_id)
        assert result.token_ids == _alone(target, prompt, settings, drafting), (prompt, settings)
        assert streamed.get(request_id, []) == result.token_ids
    batch_sizes = {shape[0] for shape in calls}
    assert len(batch_sizes) > 1, batch_sizes  # the captured steps ran while rows joined and left
    assert decoder._batcher._loop._captured
    if ON_CUDA:
        assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])


def test_compile_needs_the_static_cache_and_is_set_on_the_decoder(pair):
    with pytest.raises(ValueError, match="cache_implementation='static' and max_context"):
        sk.SpeculativeDecoder(*pair, num_speculative_tokens=GAMMA, compile=True)
    decoder = sk.SpeculativeDecoder(*pair, num_speculative_tokens=GAMMA, cache_implementation="static",
                                    max_context=32, compile=COMPILE)
    with pytest.raises(ValueError, match="compile is a setting of the decoder, not of a request .*pass "
                                         "compile=True to SpeculativeDecoder"):
        decoder.add_request([3, 4], max_new_tokens=4, compile=True)
    with pytest.raises(TypeError, match="compile"):
        sk.SpeculativeDecoder(*pair, num_speculative_tokens=GAMMA, cache_implementation="static", max_context=32,
                              compile="yes")


def test_batch_sizes_share_a_dynamic_graph_and_compile_once(pair):
    """Six requests arriving together and finishing one by one visit batch sizes 6, 5, ..., 1: with automatic
    dynamic shapes each captured step compiles a graph for the first size, one with a symbolic batch for the sizes
    after it and one for size 1 (dynamo specialises 0 and 1): at most three per step, where fixed shapes (what
    ``generate`` uses, ``dynamic=False``) would compile one per size, six. Then rounds of two requests joining the
    emptied batch and leaving it compile nothing more (joins and leaves change which rows are in use, not what the
    steps were compiled for), and each request gets model.generate's tokens."""
    target, draft = pair
    decoder = sk.SpeculativeDecoder(target, draft, num_speculative_tokens=GAMMA, max_batch_size=6,
                                    cache_implementation="static", max_context=64, compile=COUNT_GRAPHS)
    torch._dynamo.reset()  # nothing compiled by the other tests: the first requests compile
    counters.clear()
    for i in range(6):
        decoder.add_request([5 + i, 6, 7], max_new_tokens=5 * (i + 1), do_sample=False)
    sizes = set()
    while decoder.has_work():
        decoder.step()
        sizes.add(decoder._batcher._loop.batch if decoder._batcher._loop else 0)
    assert sizes >= {1, 2, 3, 4, 5, 6}, sizes
    steps = 3  # the verification step at gamma + 1, the draft steps at widths 1 and 2
    assert 0 < counters["stats"]["unique_graphs"] <= 3 * steps, dict(counters["stats"])
    for round_ in range(2):
        before = counters["stats"]["unique_graphs"]
        requests = {decoder.add_request(prompt, max_new_tokens=new, do_sample=False): (prompt, new)
                    for prompt, new in (([5 + round_, 6, 7], 8), ([9, 8, 7, 6 + round_], 4))}
        while decoder.has_work():
            decoder.step()
        assert counters["stats"]["unique_graphs"] == before, round_
        for request_id, (prompt, new) in requests.items():
            expected = target.generate(torch.tensor([prompt], device=DEVICE), max_new_tokens=new, do_sample=False,
                                       pad_token_id=0)[0, len(prompt):]
            assert decoder.result(request_id).token_ids == expected.tolist()


def test_compile_kwargs_follow_the_batch():
    options = CompileOptions()
    assert options.torch_compile_kwargs(torch.device("cpu"))["dynamic"] is False  # generate: one fixed batch
    assert options.torch_compile_kwargs(torch.device("cpu"), batch_changes=True)["dynamic"] is None
    assert CompileOptions(dynamic=False).torch_compile_kwargs(torch.device("cpu"), batch_changes=True)["dynamic"] \
        is False


def test_a_global_hook_refuses_the_step_before_it_changes_anything(pair):
    """compile=True refuses while a global module forward hook is registered (torch.compile does not guard those);
    the check sat inside the iteration, so registering one ended every running request with "error" (and made a
    start() session unusable). It now refuses the step before anything runs: the request goes on, exactly, once the
    hook is removed. (dynamo's eager backend, one batch size: the refusal comes before any compiled step runs.)"""
    from torch.nn.modules.module import register_module_forward_hook

    target, draft = pair
    decoder = sk.SpeculativeDecoder(target, draft, num_speculative_tokens=GAMMA, max_batch_size=1,
                                    cache_implementation="static", max_context=64, compile=COUNT_GRAPHS)
    request = decoder.add_request([5, 6, 7], max_new_tokens=12, do_sample=False)
    decoder.step()
    decoder.step()
    handle = register_module_forward_hook(sk.per_token_hook(lambda module, args, out: None))
    try:
        with pytest.raises(ValueError, match="compile=True cannot run while a global module forward hook"):
            decoder.step()
    finally:
        handle.remove()
    assert decoder.running == [request]
    while decoder.has_work():
        decoder.step()
    expected = target.generate(torch.tensor([[5, 6, 7]], device=DEVICE), max_new_tokens=12, do_sample=False)
    assert decoder.result(request).token_ids == expected[0, 3:].tolist()
