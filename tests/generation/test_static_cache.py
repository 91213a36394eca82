"""``cache_implementation="static"``: greedy identity with HF for batches of 1..8, rows finishing at different times
(and on their first token), per-row sampling exactness, identical tokens to the dynamic cache, O(1) rollback, the
architecture and memory checks, and one host read per iteration with compaction on."""

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, MistralConfig, MistralForCausalLM

import speculative_kernels as sk
from speculative_kernels import BatchingOptions
from speculative_kernels.generation.capabilities import check_model
from speculative_kernels.generation.memory import check_free_memory
from speculative_kernels.generation.runners.sizing import static_capacity, static_memory_bytes
from speculative_kernels.generation.runners.slot_cache import CacheLayout, SlotCache
from speculative_kernels.generation.runners.static_decoder import StaticDecoderRunner
from helpers.host_reads import step_reading_once
from helpers.models import FAMILIES, drafts_for, llama
from helpers.prompts import left_padded
from helpers.sampling import NEW, VOCAB, continuation_probs, hf_warpers, peaky
from helpers.stats import assert_matches

# (family, left-padded prompt lengths): every family, B from 1 to 8.
CASES = [("llama", [7]), ("qwen2", [5, 9]), ("gpt2", [3, 8, 1]), ("gpt2", [3, 8, 6, 1]), ("llama", [6, 2, 9, 4, 5]),
         ("qwen2", [4, 4, 7, 2, 9, 5, 6, 3]), ("llama", [2, 7, 5, 3, 8, 1, 6, 4])]


def _generate(target, draft, ids, mask, **kwargs):
    kwargs = {"num_speculative_tokens": 3, "max_new_tokens": 16, "do_sample": False, "pad_token_id": 0, **kwargs}
    return sk.generate(target, ids, attention_mask=mask, draft_model=draft, **kwargs)


@pytest.mark.parametrize("family,lengths", CASES, ids=[f"{f}-B{len(l)}" for f, l in CASES])
def test_static_greedy_matches_hf(family, lengths):
    target = FAMILIES[family]()
    draft = drafts_for(family, target)["perturbed" if len(lengths) % 2 else "unrelated"]
    ids, mask = left_padded(lengths, seed=len(lengths))
    expected = target.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0)
    stats = sk.SpeculationStats()
    got = _generate(target, draft, ids, mask, cache_implementation="static", speculation_stats=stats)
    assert torch.equal(got, expected)


def test_mistral_sliding_window_wide_or_binding_is_exact():
    torch.manual_seed(0)
    config = MistralConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1,
                           eos_token_id=2, pad_token_id=0)  # sliding_window 4096
    target = MistralForCausalLM(config).eval()
    ids, mask = left_padded([5, 9, 3])
    expected = target.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    got = _generate(target, target, ids, mask, max_new_tokens=12, cache_implementation="static")
    assert torch.equal(got, expected)
    config.sliding_window = 4  # binds: applied by the masks over real positions, the cache keeps every slot
    narrow = MistralForCausalLM(config).eval()
    expected = narrow.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    draft = MistralForCausalLM(config).eval()  # other random weights: rejections
    stats = sk.SpeculationStats()
    got = _generate(narrow, draft, ids, mask, max_new_tokens=12, cache_implementation="static",
                    speculation_stats=stats)
    assert torch.equal(got, expected) and stats.acceptance_rate < 1.0


def test_rows_finish_at_different_times_and_on_first_token():
    target, draft = llama(), llama(layers=1, seed=8)
    ids, mask = left_padded([6, 4, 7, 5, 3, 8], seed=2)
    free = target.generate(ids, attention_mask=mask, max_new_tokens=14, do_sample=False, eos_token_id=None,
                           pad_token_id=0)
    eos = int(free[1, ids.shape[1]])  # row 1's very first new token becomes EOS
    expected = target.generate(ids, attention_mask=mask, max_new_tokens=14, do_sample=False, eos_token_id=eos,
                               pad_token_id=0)
    stats = sk.SpeculationStats()
    got = _generate(target, draft, ids, mask, num_speculative_tokens=4, max_new_tokens=14, eos_token_id=eos,
                    cache_implementation="static", speculation_stats=stats,
                    batching=BatchingOptions(drop_finished_fraction=0.1))
    assert torch.equal(got, expected)
    assert got[1, ids.shape[1]] == eos and bool((got[1, ids.shape[1] + 1:] == 0).all())
    assert stats.dropped_rows >= 1
    lengths = [row.index(eos) + 1 if eos in row else len(row) for row in got[:, ids.shape[1]:].tolist()]
    assert stats.new_tokens == sum(lengths)


@pytest.mark.parametrize("do_sample", [False, True])
def test_static_and_dynamic_give_identical_tokens(do_sample):
    target = FAMILIES["qwen2"]()
    draft = drafts_for("qwen2", target)["perturbed"]
    ids, mask = left_padded([3, 8, 6, 1, 5], seed=4)
    runs = []
    for cache in ("dynamic", "static"):
        torch.manual_seed(7)
        runs.append(_generate(target, draft, ids, mask, max_new_tokens=20, do_sample=do_sample, temperature=0.9,
                              top_k=20, cache_implementation=cache))
    assert torch.equal(*runs)


def test_dropping_finished_rows_does_not_change_any_row():
    """Per-row Philox keys: a row's sampled tokens are the same whether finished rows leave the batch or not."""
    target, draft = peaky(0, 2), peaky(7, 1)
    target.generation_config.eos_token_id = draft.generation_config.eos_token_id = 2
    ids = torch.randint(3, VOCAB, (12, 4), generator=torch.Generator().manual_seed(3))
    runs, stats = [], []
    for fraction in (None, 0.1):
        torch.manual_seed(5)
        stats.append(sk.SpeculationStats())
        runs.append(_generate(target, draft, ids, None, max_new_tokens=12, do_sample=True, eos_token_id=2,
                              cache_implementation="static", speculation_stats=stats[-1],
                              batching=BatchingOptions(drop_finished_fraction=fraction)))
    assert stats[0].dropped_rows == 0 and stats[1].dropped_rows > 0
    assert torch.equal(*runs)


@pytest.mark.parametrize("temperature,top_k,top_p,gamma", [(1.0, 0, 1.0, 2), (0.8, 3, 0.9, 3)])
def test_sampling_exact_per_row(temperature, top_k, top_p, gamma):
    """Each of 4000 rows of one static-cache batch is a sample of the target's HF sampling distribution (rows
    finish at different times, holes are compacted, finished rows leave the batch)."""
    target, draft = peaky(0, 2), peaky(7, 1)
    prompt = torch.tensor([[1, 4, 3, 5]])
    seqs, probs = continuation_probs(target, prompt, hf_warpers(temperature, top_k, top_p))
    torch.manual_seed(4321)
    stats = sk.SpeculationStats()
    out = sk.generate(target, prompt.expand(4000, -1), draft_model=draft, num_speculative_tokens=gamma,
                      do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=NEW,
                      pad_token_id=0, cache_implementation="static", speculation_stats=stats)
    new = out[:, prompt.shape[1]:].numpy()
    codes = (new * VOCAB ** np.arange(NEW - 1, -1, -1)).sum(axis=1)
    assert_matches(np.bincount(codes, minlength=VOCAB**NEW), probs)


def test_rollback_is_a_pointer_move_not_a_copy():
    target = llama()
    runner = StaticDecoderRunner(target, check_model(target, path="static", batch=2), 2, 32, torch.device("cpu"),
                                 reserve=4)
    pointers = [t.data_ptr() for t in runner.cache.tensors()]
    tokens = torch.randint(3, 97, (2, 5))
    runner.forward(tokens)
    before = [t.clone() for t in runner.cache.tensors()]
    runner.keep_prefix(5, torch.tensor([2, 4]), 4)
    assert runner.num_slots == 4 and int(runner.cache.position) == 4
    # the cut slots are back to 1: slots no forward has written are 1 (a forward of real tokens writes no mask)
    assert runner.slot_mask[:, :6].tolist() == [[1, 1, 0, 0, 1, 1], [1, 1, 1, 1, 1, 1]]
    assert runner.next_position.tolist() == [2, 4]
    assert [t.data_ptr() for t in runner.cache.tensors()] == pointers
    assert all(torch.equal(a, b) for a, b in zip(before, runner.cache.tensors()))  # nothing moved


def _latent():
    """DeepSeek V3 (multi-head latent attention: keys and values of other head sizes, one head)."""
    return _tiny("deepseek_v3", kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                 v_head_dim=8, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
                 topk_group=1, first_k_dense_replace=1)


def test_memory_estimate_matches_the_allocation():
    for make in (*FAMILIES.values(), _latent, lambda: _tiny("falcon")):
        model = make()
        spec = check_model(model, path="static", batch=3)
        layout = CacheLayout.of(model, spec)
        cache = SlotCache(layout, 3, 40, torch.device("cpu"))
        allocated = sum(t.numel() * t.element_size() for t in cache.tensors())
        assert static_memory_bytes([layout], [spec], 3, 40, queries=5)["kv_caches"] == allocated


@pytest.mark.parametrize("window", [None, 8])
def test_memory_estimate_covers_the_prefill_masks_and_the_runners_rows(monkeypatch, window):
    """The check's estimate covers what a static call holds: the runners' per-row buffers (slot masks, the
    additive mirror) and the largest forward's masks, which is the prefill's [B, 1, P, C] for a long prompt (the
    estimate counted a verification forward's gamma + 1 queries only: with P = 120 the prefill's masks were about
    twenty times that; they grow as P * C, past the K/V for long prompts)."""
    from speculative_kernels.generation.runners import factory, static_decoder

    torch.manual_seed(0)
    config = MistralConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1,
                           eos_token_id=2, pad_token_id=0, sliding_window=window)
    target = MistralForCausalLM(config).eval()
    estimates, masks, rows = [], [], []
    real_check, real_mask, real_init = factory.check_free_memory, static_decoder.decoder_mask, \
        StaticDecoderRunner.__init__

    def check(required, *args):
        estimates.append(required)
        return real_check(required, *args)

    def mask(*args):
        built = real_mask(*args)
        masks.append(sum(m.numel() * m.element_size() for m in (built.values() if isinstance(built, dict) else [built])))
        return built

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        rows.append(sum(t.numel() * t.element_size() for t in self._rows[:2] if t is not None))

    monkeypatch.setattr(factory, "check_free_memory", check)
    monkeypatch.setattr(static_decoder, "decoder_mask", mask)
    monkeypatch.setattr(StaticDecoderRunner, "__init__", init)
    ids = torch.randint(3, 97, (2, 120))
    ids[0, :7] = 0
    mask_ = (ids != 0).long()
    _generate(target, target, ids, mask_, max_new_tokens=4, num_speculative_tokens=3, cache_implementation="static")
    (estimate,) = estimates
    assert estimate["slot_masks"] >= sum(rows)
    # the masks a forward holds at once: the additive one(s) plus their bool precursors (at most one byte per
    # entry each, three of them with a window)
    entries = max(masks) // 4  # float32 additive entries
    assert estimate["attention_mask"] >= max(masks) + entries * (1 if window is None else 3)


def test_capacity_bound_and_batch_one_has_no_slack():
    assert static_capacity(10, 100, 4, 1, 0.25) == 10 + 100 + 2 * 5 + 2
    assert static_capacity(10, 100, 4, 8, 0.25) == 122 + 31


def test_free_memory_check_raises_before_allocating(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (3 * 2**30, 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 2**30)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)
    need = {"kv_caches": 5 * 2**30, "slot_masks": 0, "attention_mask": 0, "total": 5 * 2**30}
    with pytest.raises(MemoryError, match=r"needs 5.00 GiB .* only 4.00 GiB are free"):
        check_free_memory(need, torch.device("cuda", 0), "the static caches")
    check_free_memory({**need, "total": 3 * 2**30}, torch.device("cuda", 0), "the static caches")
    with pytest.raises(MemoryError, match="the static caches needs .* GiB are free on cpu"):  # the CPU is checked too
        check_free_memory({**need, "total": 10**15}, torch.device("cpu"), "the static caches")


def _tiny(arch, **kwargs):
    torch.manual_seed(0)
    config = AutoConfig.for_model(arch, vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, bos_token_id=1, eos_token_id=2, pad_token_id=0, **kwargs)
    return AutoModelForCausalLM.from_config(config).eval()


def test_a_write_the_layout_does_not_describe_is_named():
    """Each layer's K and V buffers have their own head size (multi-head latent attention caches a kv_lora_rank-wide
    latent as keys and a qk_rope_head_dim-wide one as values), and every write is checked against both: values of
    another size fail naming the architecture (they failed inside index_copy_ before, when only the keys were
    checked), and a write that fits returns [B, H_kv, C, D_k] keys and [B, H_kv, C, D_v] values."""
    cache = SlotCache(CacheLayout("TinyForCausalLM", ((1, 16, 8),), torch.float32), 2, 12, torch.device("cpu"))
    keys, values = torch.randn(2, 1, 3, 16), torch.randn(2, 1, 3, 8)
    with pytest.raises(ValueError, match=r"TinyForCausalLM: the static cache expected keys and values of shapes "
                                         r"\(2, 1, 3, 16\), \(2, 1, 3, 8\).*got \(2, 1, 3, 16\).*\(2, 1, 3, 16\)"):
        cache.update(keys, torch.randn(2, 1, 3, 16), 0)
    got_keys, got_values = cache.update(keys, values, 0)
    assert got_keys.shape == (2, 1, 12, 16) and got_values.shape == (2, 1, 12, 8)
    assert torch.equal(got_keys[:, :, :3], keys) and torch.equal(got_values[:, :, :3], values)


def test_attention_without_4d_masks_is_refused_by_name():
    model = llama()
    model.config._attn_implementation = "flex_attention"
    with pytest.raises(ValueError, match="LlamaForCausalLM.*attn_implementation='flex_attention' takes no 4-D mask"):
        check_model(model, path="static")


def test_static_refusals():
    target = llama()
    ids = torch.tensor([[1, 5, 6]])
    with pytest.raises(ValueError, match="needs the static cache"):
        sk.generate(target, ids, draft_model=target, max_new_tokens=4, compile=True, cache_implementation="dynamic")
    with pytest.raises(ValueError, match="cache_implementation='offloaded' is not supported"):
        sk.generate(target, ids, draft_model=target, max_new_tokens=4, cache_implementation="offloaded")
    with pytest.raises(TypeError, match="compile must be"):
        sk.generate(target, ids, draft_model=target, max_new_tokens=4, compile="yes")
    with pytest.raises(ValueError, match="compaction_threshold"):
        BatchingOptions(compaction_threshold=0.0)


def test_one_host_read_per_iteration_with_compaction():
    target, draft = llama(), llama(layers=1, seed=4)
    ids = torch.randint(3, 97, (5, 6), generator=torch.Generator().manual_seed(0))
    session = sk.SpeculativeDecoder(target, draft, num_speculative_tokens=3).start(
        ids, max_new_tokens=24, pad_token_id=0, do_sample=True, temperature=0.8, cache_implementation="static")
    step_reading_once(session)
    assert session.stats.compactions > 0  # of either cache


@pytest.mark.parametrize("alias", ["sliding_window", "hybrid_chunked"])
@pytest.mark.parametrize("where", ["call", "model generation_config"])
def test_transformers_deprecated_static_names_run_the_static_cache(alias, where):
    """transformers 5.x builds its static cache for these deprecated names (a checkpoint's generation_config may
    still carry one); so do we, and the tokens are model.generate's."""
    from speculative_kernels.generation.request import build_loop

    target = llama()
    draft = drafts_for("llama", target)["perturbed"]
    ids = torch.randint(3, 97, (2, 6), generator=torch.Generator().manual_seed(5))
    kwargs = {} if where != "call" else {"cache_implementation": alias}
    if where != "call":
        target.generation_config.cache_implementation = alias
    common = dict(max_new_tokens=10, do_sample=False, pad_token_id=0, **kwargs)
    expected = target.generate(ids, **common)
    assert torch.equal(sk.generate(target, ids, draft_model=draft, num_speculative_tokens=3, **common), expected)
    loop = build_loop(target, draft, ids, num_speculative_tokens=3, **common)
    assert isinstance(loop.target_runner, StaticDecoderRunner)


def test_the_cpu_check_sees_the_process_address_space_limit():
    """Under RLIMIT_AS (or a container's cgroup limit) the host's MemAvailable overstates what an allocation can get:
    the static cache passed the check, then failed in torch's allocator instead of the named MemoryError. The soft
    limit is lowered in this process only while free_bytes reads it (the hard limit is left alone, so it can be
    raised back; a subprocess for this spent most of its ~5-14 s importing the package)."""
    import os
    import resource

    from speculative_kernels.generation.memory import free_bytes

    before = resource.getrlimit(resource.RLIMIT_AS)
    virtual = int(open("/proc/self/statm").read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    limit = virtual + 300 * 2**20 if before[1] == resource.RLIM_INFINITY else min(virtual + 300 * 2**20, before[1])
    resource.setrlimit(resource.RLIMIT_AS, (limit, before[1]))
    try:
        free = free_bytes(torch.device("cpu"))
    finally:
        resource.setrlimit(resource.RLIMIT_AS, before)
    assert free <= 300 * 2**20
