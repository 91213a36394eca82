"""``generate(..., compile=True)``: captured draft/verification steps give the eager static path's tokens.

CPU: the steps go through dynamo with the ``aot_eager`` backend (fast to build) and, once, through inductor's default
mode (what ``compile=True`` picks on CPU). CUDA (skipped elsewhere, with the reason): ``mode="reduce-overhead"``
records CUDA graphs without skips, and the steady-state loop synchronises with the host once per iteration.
"""

import pytest
import torch
from torch._dynamo.utils import counters

import speculative_kernels as sk
from speculative_kernels import CompileOptions
from speculative_kernels.generation.request import build_loop
from helpers.host_reads import CudaSyncSites
from helpers.models import FAMILIES, drafts_for, llama

ON_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if ON_CUDA else "cpu"
TRACE_ONLY = CompileOptions(backend="aot_eager")
needs_cuda = pytest.mark.skipif(not ON_CUDA, reason="CUDA graphs (mode='reduce-overhead') need a CUDA device")


def _pair(family):
    target = FAMILIES[family]().to(DEVICE)
    return target, drafts_for(family, target)["perturbed"].to(DEVICE)


@pytest.fixture(scope="module")
def llama_pair():
    """One pair for the module: captured graphs are specialised to the models, so tests sharing it compile once."""
    return _pair("llama")


def _prompt(batch=1, length=7, seed=0):
    return torch.randint(3, 97, (batch, length), generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def test_compiled_greedy_matches_hf_and_reuses_graphs(llama_pair):
    target, draft = llama_pair
    ids = _prompt()
    expected = target.generate(ids, max_new_tokens=20, do_sample=False, pad_token_id=0)
    options = TRACE_ONLY if not ON_CUDA else CompileOptions()
    stats = []
    for _ in range(2):
        graphs = counters["stats"]["unique_graphs"]
        stats.append(sk.SpeculationStats())
        got = sk.generate(target, ids, draft_model=draft, num_speculative_tokens=3, max_new_tokens=20,
                          do_sample=False, compile=options, speculation_stats=stats[-1])
        assert torch.equal(got, expected)
    assert counters["stats"]["unique_graphs"] == graphs  # the second call compiled nothing new
    assert all(s.warmup_time_s > 0 and s.total_time_s > 0 for s in stats)
    assert stats[0].target_forwards == stats[1].target_forwards > 0  # warm-up forwards are not counted


def test_calls_of_other_lengths_reuse_the_compiled_steps(llama_pair):
    """Prompts of other lengths (and other max_new_tokens) in one bucket of cache sizes reuse the captured steps. Each
    length compiled them anew (specialised to the cache's slot count), and a process hit dynamo's recompile limit
    after ~21 lengths with a raw FailOnRecompileLimitHit; the sizes are bucketed now (sizing.captured_capacity)."""
    target, draft = llama_pair
    options = TRACE_ONLY if not ON_CUDA else CompileOptions()
    kwargs = dict(draft_model=draft, num_speculative_tokens=3, do_sample=False, compile=options, pad_token_id=0)
    sk.generate(target, _prompt(length=5), max_new_tokens=8, **kwargs)
    graphs = counters["stats"]["unique_graphs"]
    for length, new in ((6, 8), (9, 8), (14, 12), (20, 10)):
        ids = _prompt(length=length, seed=length)
        got = sk.generate(target, ids, max_new_tokens=new, **kwargs)
        assert torch.equal(got, target.generate(ids, max_new_tokens=new, do_sample=False, pad_token_id=0))
    assert counters["stats"]["unique_graphs"] == graphs


def test_a_hook_registered_after_capture_is_applied(llama_pair):
    """A forward hook (activation steering, say) registered on the target after a compiled call: dynamo skips its
    guards on module hooks by default, so the captured steps, reused by later calls, ran without it while the eager
    prefill ran with it (tokens of neither model.generate with the hook nor without it, silently). The captured
    calls guard on hooks: the steps are traced again with it, and again once it is removed."""
    target, draft = llama_pair
    ids = _prompt(seed=5)
    options = TRACE_ONLY if not ON_CUDA else CompileOptions()
    kwargs = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)

    def ours():
        return sk.generate(target, ids, draft_model=draft, num_speculative_tokens=3, compile=options, **kwargs)

    assert torch.equal(ours(), target.generate(ids, **kwargs))
    steer = torch.randn(target.config.hidden_size, generator=torch.Generator().manual_seed(9)).to(DEVICE) * 2
    handle = target.model.layers[0].register_forward_hook(sk.per_token_hook(
        lambda module, args, output: (output[0] + steer, *output[1:]) if isinstance(output, tuple) else output + steer))
    try:
        expected = target.generate(ids, **kwargs)
        got = ours()
    finally:
        handle.remove()
    plain = target.generate(ids, **kwargs)
    assert not torch.equal(expected, plain)
    assert torch.equal(got, expected)
    assert torch.equal(ours(), plain)


def test_compile_settings_that_would_do_nothing_or_come_from_a_checkpoint():
    """CompileOptions.mode with a backend that has no modes was dropped silently: refused. A checkpoint's
    cache_implementation="dynamic" (a default) made compile= fail as if the call had asked for both: compile wins.
    SpeculativeDecoder.start() takes generate's compile= (it was refused as unknown to generate)."""
    import copy

    with pytest.raises(ValueError, match="CompileOptions.mode='reduce-overhead' applies to the inductor backend"):
        CompileOptions(backend="aot_eager", mode="reduce-overhead")
    target = llama()
    model = copy.deepcopy(target)
    model.generation_config.cache_implementation = "dynamic"
    ids = _prompt()
    expected = target.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    got = sk.generate(model, ids, draft_model=target, num_speculative_tokens=2, max_new_tokens=6, do_sample=False,
                      pad_token_id=0, compile=TRACE_ONLY)
    assert torch.equal(got, expected)
    with pytest.raises(ValueError, match="needs the static cache"):
        sk.generate(model, ids, draft_model=target, max_new_tokens=6, cache_implementation="dynamic",
                    compile=TRACE_ONLY)
    session = sk.SpeculativeDecoder(target, target, num_speculative_tokens=2).start(
        ids, max_new_tokens=6, do_sample=False, pad_token_id=0, compile=TRACE_ONLY)
    assert session._loop._captured
    emitted = []
    while not session.finished:
        emitted += session.step()[0]
    assert emitted == expected[0, ids.shape[1]:].tolist()


def test_compiled_sampling_matches_eager_static(llama_pair):
    target, draft = llama_pair
    ids = _prompt(seed=2)
    runs = []
    for compile in (False, TRACE_ONLY):
        torch.manual_seed(11)
        runs.append(sk.generate(target, ids, draft_model=draft, num_speculative_tokens=3, max_new_tokens=24,
                                do_sample=True, temperature=0.8, top_k=20, top_p=0.9, compile=compile,
                                cache_implementation="static"))
    assert torch.equal(*runs)


def test_compiled_batch_keeps_every_row():
    """Batches compile too (fixed shapes: finished rows are not dropped), with left padding (GPT-2)."""
    target, draft = _pair("gpt2")
    ids = _prompt(batch=3, length=6, seed=4)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    expected = target.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    stats = sk.SpeculationStats()
    got = sk.generate(target, ids, attention_mask=mask, draft_model=draft, num_speculative_tokens=3,
                      max_new_tokens=12, do_sample=False, pad_token_id=0, compile=TRACE_ONLY, speculation_stats=stats)
    assert torch.equal(got, expected)
    assert stats.dropped_rows == 0


@pytest.mark.skipif(ON_CUDA, reason="the CPU default (inductor, mode='default'); CUDA is checked below")
def test_compile_true_on_cpu_uses_inductor_and_matches_hf():
    """Greedy: model.generate's tokens. Then seeded sampling on the same captured steps: no new graph (the sampling
    settings are outside the steps: a server varying them must not recompile) and the eager static path's samples
    for the same seed (the rest of test_compile checks that with aot_eager only, whose numerics are eager's). The LM
    heads are sharpened in place first (near-uniform draws hide a wrong logit: a captured step's logits 25% off
    drew the same 24 tokens unsharpened), which the captured steps read (weights are their inputs, not constants)."""
    target, draft = llama(layers=1), llama(layers=1, seed=5)
    ids = _prompt(length=5, seed=6)
    expected = target.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert CompileOptions().torch_compile_kwargs(torch.device("cpu")) == {"backend": "inductor", "dynamic": False,
                                                                           "mode": "default"}
    got = sk.generate(target, ids, draft_model=draft, num_speculative_tokens=2, max_new_tokens=8, do_sample=False,
                      compile=True)
    assert torch.equal(got, expected)
    with torch.no_grad():
        target.lm_head.weight.mul_(8.0)
        draft.lm_head.weight.mul_(8.0)
    graphs = counters["stats"]["unique_graphs"]
    sampling = dict(draft_model=draft, num_speculative_tokens=2, max_new_tokens=24, do_sample=True, temperature=0.8,
                    top_k=20, top_p=0.9, seed=3)
    sampled = sk.generate(target, ids, compile=True, **sampling)
    assert counters["stats"]["unique_graphs"] == graphs
    assert torch.equal(sampled, sk.generate(target, ids, cache_implementation="static", **sampling))


@needs_cuda
def test_cuda_graphs_record_without_skips(llama_pair):
    assert CompileOptions().torch_compile_kwargs(torch.device("cuda"))["mode"] == "reduce-overhead"
    target, draft = llama_pair
    ids = _prompt(seed=9)
    expected = target.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=0)
    counters.clear()
    got = sk.generate(target, ids, draft_model=draft, num_speculative_tokens=3, max_new_tokens=24, do_sample=False,
                      compile=True)
    assert torch.equal(got, expected)
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])


@needs_cuda
def test_one_host_sync_per_iteration_when_captured(llama_pair):
    """After warm-up, CUDA's sync debug mode flags every synchronising call: at most the iteration's read each step."""
    target, draft = llama_pair
    with torch.inference_mode():
        loop = build_loop(target, draft, _prompt(seed=3), num_speculative_tokens=3, max_new_tokens=30,
                          do_sample=True, compile_options=CompileOptions())  # captured and warmed up
        steps, running = 0, True
        with CudaSyncSites() as syncs:
            while running:
                running = loop.step()
                steps += 1
    assert steps > 1 and len(syncs.sites) <= steps, "\n".join(syncs.summary())


def test_a_request_that_fills_a_position_table_compiles_no_wider_than_it_verifies():
    """The captured verification step was built and warmed up gamma + 1 tokens wide right after the prefill, at
    positions a request with max_new_tokens - 1 < gamma never reaches: GPT-2 with a 16-position table, prompt 14
    and 2 new tokens (which model.generate serves) crashed with an IndexError inside its position embedding (and
    a "dynamic" rotary model had its frequencies enlarged: other tokens). It is captured no wider than a call
    verifies."""
    from helpers.models import gpt2

    def short(seed, layers):
        model = gpt2(seed=seed, layers=layers)
        model.transformer.wpe = torch.nn.Embedding(16, model.config.n_embd)
        model.config.n_positions = 16
        return model.eval().to(DEVICE)

    target, draft = short(0, 2), short(1, 1)
    ids = torch.randint(3, 97, (1, 14), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    kwargs = dict(max_new_tokens=2, do_sample=False, pad_token_id=0, eos_token_id=None)
    got = sk.generate(target, ids, draft_model=draft, num_speculative_tokens=3,
                      compile=TRACE_ONLY if not ON_CUDA else CompileOptions(), **kwargs)
    assert torch.equal(got, target.generate(ids, **kwargs))


def test_a_global_module_hook_is_refused_under_compile():
    """torch.compile does not guard global module hooks: a register_module_forward_hook made after an earlier
    compiled call was left out of the captured steps that later calls reuse (a mix of hooked and unhooked steps,
    silently). compile=True now refuses while one is registered; without it, the hook is honoured eagerly."""
    from torch.nn.modules.module import register_module_forward_hook

    target = llama().to(DEVICE)
    ids = _prompt()
    shift = torch.randn(target.config.hidden_size, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    compiled = dict(cache_implementation="static", compile=TRACE_ONLY)
    baseline = sk.generate(target, ids, draft_model=target, num_speculative_tokens=2, max_new_tokens=8,
                           do_sample=False, **compiled)
    assert torch.equal(baseline, target.generate(ids, max_new_tokens=8, do_sample=False))
    handle = register_module_forward_hook(sk.per_token_hook(lambda module, args, out: out + shift
                                                            if module is target.model.norm else None))
    try:
        with pytest.raises(ValueError, match="compile=True cannot run while a global module forward hook"):
            sk.generate(target, ids, draft_model=target, num_speculative_tokens=2, max_new_tokens=8,
                        do_sample=False, **compiled)
        expected = target.generate(ids, max_new_tokens=8, do_sample=False)
        got = sk.generate(target, ids, draft_model=target, num_speculative_tokens=2, max_new_tokens=8,
                          do_sample=False)
    finally:
        handle.remove()
    assert torch.equal(got, expected) and not torch.equal(expected, baseline)
