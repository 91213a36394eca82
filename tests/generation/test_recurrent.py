"""Models with conv / SSM / linear-attention states at batch 1 (``runners/recurrent.py``): token-identical to
model.generate with rejected drafts (a snapshot restored, the accepted tokens re-run), one host read per iteration;
Mamba (whose multi-token forward restarts its scan), batches, the static cache and padded prompts refused by name."""

import numpy as np
import pytest
import torch
import transformers
from transformers import (
    GraniteMoeHybridConfig,
    GraniteMoeHybridForCausalLM,
    Lfm2Config,
    Lfm2ForCausalLM,
    Mamba2Config,
    Mamba2ForCausalLM,
    MambaConfig,
    MambaForCausalLM,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)

import speculative_kernels as sk
from speculative_kernels.generation.capabilities import check_model
from speculative_kernels.generation.runners.recurrent import RecurrentRunner
from helpers.host_reads import count_reads_per_loop_step
from helpers.models import llama, perturbed
from helpers.sampling import NEW, continuation_probs, hf_warpers
from helpers.sampling import VOCAB as SAMPLING_VOCAB
from helpers.stats import assert_matches
from test_half_precision import assert_as_accurate_as_hf
from test_recurrent_step_size import nemotron_h, zamba2

VOCAB = 97


def _build(model_class, config, seed: int = 0):
    config.tie_word_embeddings = False  # (tied tiny random models repeat their input, which any draft guesses)
    torch.manual_seed(seed)
    return model_class(config).eval()


def mamba2():
    return _build(Mamba2ForCausalLM, Mamba2Config(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_heads=8,
                                                  head_dim=8, state_size=8, expand=2, n_groups=1, chunk_size=4))


def qwen3_next():  # gated DeltaNet layers beside full attention (whose K/V the rollback cuts)
    return _build(Qwen3NextForCausalLM, Qwen3NextConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8,
        linear_value_head_dim=8, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=16,
        shared_expert_intermediate_size=16, layer_types=["linear_attention", "full_attention"]))


def granite_hybrid():  # Mamba2 layers beside attention (Granite 4)
    return _build(GraniteMoeHybridForCausalLM, GraniteMoeHybridConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, layer_types=["mamba", "attention"], mamba_n_heads=4, mamba_d_head=16,
        mamba_d_state=8, mamba_n_groups=1, mamba_chunk_size=4, mamba_expand=2, num_local_experts=0))


def lfm2():  # short conv layers (a conv state only) beside attention
    return _build(Lfm2ForCausalLM, Lfm2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                              layer_types=["conv", "full_attention"], bos_token_id=1,
                                              eos_token_id=2, pad_token_id=0))


def _state_heavy(model):
    """``model`` with its SSM skip (D) zeroed: at the tiny sizes above the recurrent (SSM / DeltaNet) states are
    ~1e-2 or smaller and the logits barely read them (a wrong SSM state changed no greedy token), so a rollback that
    restored the conv states alone passed every test. With D = 0 (and larger weights) a Mamba2 mixer's output is
    its state's."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(getattr(module, "D", None), torch.nn.Parameter):
                module.D.zero_()
    return model


def mamba2_ssm():
    return _state_heavy(mamba2())


def granite_hybrid_ssm():
    config = granite_hybrid().config
    config.initializer_range = 0.2
    return _state_heavy(_build(GraniteMoeHybridForCausalLM, config))


def qwen3_next_ssm():
    config = qwen3_next().config
    config.initializer_range = 0.2
    return _build(Qwen3NextForCausalLM, config)


def _prompt(length: int = 7, seed: int = 0):
    return torch.randint(3, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))


def _expected(target, ids, new):
    return target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                           pad_token_id=0)


@pytest.mark.parametrize("make", [mamba2, qwen3_next, granite_hybrid, lfm2])
def test_greedy_is_token_identical_with_rejected_drafts(make, monkeypatch):
    """A perturbed copy as the draft (a recurrent draft, rolled back to its mark at n) and prompt lookup: at every
    partly rejected iteration the target is restored and its next forward feeds [last, d_1..d_n] first (or re-runs
    them, past gamma + 1 pending tokens). Refused before."""
    target = make()
    draft = perturbed(target, 0.3)
    runners = []
    init = RecurrentRunner.__init__

    def recorded(runner, *args, **kwargs):
        init(runner, *args, **kwargs)
        runners.append(runner)

    monkeypatch.setattr(RecurrentRunner, "__init__", recorded)
    for seed, kwargs in ((0, dict(draft_model=draft, num_speculative_tokens=3)),
                         (1, dict(prompt_lookup_num_tokens=2))):
        ids = _prompt(7 + seed, seed)
        got = sk.generate(target, ids, attention_mask=torch.ones_like(ids), max_new_tokens=14, do_sample=False,
                          pad_token_id=0, **kwargs)
        assert torch.equal(got, _expected(target, ids, 14))
    target_runners = [runners[0], runners[2]]  # (the first call's draft runner is runners[1])
    assert all(r.restores > 0 for r in target_runners)  # partly rejected iterations: restores were exercised
    assert sum(r.restores for r in target_runners) > sum(r.reruns for r in target_runners)  # most folded


@pytest.mark.parametrize("make", [mamba2_ssm, granite_hybrid_ssm, qwen3_next_ssm])
def test_rejected_drafts_restore_the_recurrent_states(make, monkeypatch):
    """Models whose logits read their SSM / DeltaNet state (``_state_heavy``): a rollback that restored the conv
    states but not the recurrent ones passed the test above."""
    target = make()
    restores = []
    keep_prefix = RecurrentRunner.keep_prefix

    def recorded(runner, *args, **kwargs):
        before = runner.restores
        keep_prefix(runner, *args, **kwargs)
        restores.append(runner.restores - before)

    monkeypatch.setattr(RecurrentRunner, "keep_prefix", recorded)
    for seed, kwargs in ((0, dict(draft_model=perturbed(target, 0.3), num_speculative_tokens=3)),
                         (1, dict(prompt_lookup_num_tokens=2))):
        ids = _prompt(7 + seed, seed)
        got = sk.generate(target, ids, attention_mask=torch.ones_like(ids), max_new_tokens=14, do_sample=False,
                          pad_token_id=0, **kwargs)
        assert torch.equal(got, _expected(target, ids, 14))
    assert sum(restores) > 2


def test_the_runner_alone_restores_folds_and_re_runs_as_documented():
    """RecurrentRunner driven as the loop and the draft drive it (Mamba2 reading its SSM state): a fully kept
    verification restores nothing; a partly kept one leaves [last, d_1..d_n] pending, folded into the next forward
    (whose logits are the new positions' only, and model.generate's), re-run once more than ``defer`` (= gamma + 1)
    are pending, exactly ``defer`` still folded; a draft's rollback of one-token steps is a restore alone (a mark at
    the kept slot); the kept tokens are copies (the caller may refill its buffer). Output-equivalent mutants of these
    (a restore of nothing, an earlier mark, re-running at defer, no logits_to_keep) passed the generate tests."""
    model = mamba2_ssm()
    ids = _prompt(40, 5)
    with torch.no_grad():
        reference = model(ids).logits  # [1, 40, V]: one forward over the whole sequence
    positions = []
    runner = RecurrentRunner(model, check_model(model), torch.device("cpu"), reserve=4)  # gamma 3
    model.lm_head.register_forward_hook(lambda module, args, out: positions.append(out.shape[1]))
    assert runner.defer == 4

    def run(start, end, **kwargs):
        logits = runner.forward(ids[:, start:end].clone(), **kwargs)
        torch.testing.assert_close(logits, reference[:, end - logits.shape[1] : end], atol=1e-4, rtol=0)

    def keep(width, kept):
        runner.keep_prefix(width, None, kept, [kept])
        assert runner.marks == [] and runner.fed == []

    with torch.no_grad():
        run(0, 8, last_only=True, prompt=True)
        assert runner.marks == []
        run(8, 12)  # a verification of [last, d1..d3], all kept: nothing restored
        keep(4, 4)
        assert (runner.restores, runner.pending, runner.num_slots) == (0, None, 12)
        buffer = ids[:, 12:16].clone()
        runner.forward(buffer)
        buffer.fill_(0)  # (a caller's buffer refilled after the forward)
        keep(4, 2)  # [last, d1] kept: restored to slot 12, both pending
        assert (runner.restores, runner.reruns, runner.num_slots) == (1, 0, 14)
        assert torch.equal(runner.pending, ids[:, 12:14])
        positions.clear()
        run(14, 18)  # the pending two ride along: logits of the 4 new positions only
        assert positions == [4]
        keep(4, 2)  # 2 + 2 = 4 = defer pending: still folded
        assert (runner.restores, runner.reruns) == (2, 0) and torch.equal(runner.pending, ids[:, 12:16])
        run(16, 20)
        keep(4, 1)  # 4 + 1 > defer: re-run at once
        assert (runner.restores, runner.reruns, runner.pending, runner.num_slots) == (3, 1, None, 17)
        for end in range(18, 21):  # a draft's one-token steps (the first after its pending token), then 1 of 3 kept
            run(end - 1, end, last_only=True)
        keep(3, 1)
        assert (runner.restores, runner.reruns, runner.pending, runner.num_slots) == (4, 1, None, 18)
        run(18, 22)


def test_sampling_with_top_k_1_is_greedy_through_the_sampled_path():
    """do_sample with top_k=1 (the sampled verification, q kept) on a Mamba2 target and draft: model.generate's
    greedy tokens, the rollbacks included."""
    target = mamba2()
    draft = perturbed(target, 0.3)
    ids = _prompt(5, 3)
    stats = sk.SpeculationStats()
    got = sk.generate(target, ids, attention_mask=torch.ones_like(ids), draft_model=draft, num_speculative_tokens=4,
                      max_new_tokens=14, do_sample=True, top_k=1, pad_token_id=0, speculation_stats=stats)
    assert torch.equal(got, _expected(target, ids, 14))
    assert stats.acceptance_rate < 1.0


def _sharp(make, layers: int | None = None):
    """``make``'s architecture over helpers.sampling's 6-token vocabulary, reading its recurrent state (D = 0,
    initializer_range 0.2) with its output layer scaled x6 (a few continuations hold most of the mass, so a wrong
    state moves it to rare ones), without EOS: a target whose continuation distribution can be enumerated."""
    base = make()
    config = base.config
    config.vocab_size, config.initializer_range = SAMPLING_VOCAB, 0.2
    if layers is not None:  # (Mamba2's layer_types follow its layer count)
        config.num_hidden_layers = layers
    model = _state_heavy(_build(type(base), config))
    with torch.no_grad():
        model.lm_head.weight.mul_(6.0)
    model.generation_config.eos_token_id = None
    return model


SAMPLING_ROWS = 30  # one generate call each (batch 1), ~0.13 s each on a loaded CPU


@pytest.mark.parametrize("make,layers", [(mamba2, 1), (granite_hybrid, None)])
def test_sampled_continuations_follow_the_target_through_rollbacks(make, layers):
    """do_sample with a perturbed recurrent draft that is often rejected (2-3 restores per call, kept tokens folded
    into the next verification): whole continuations of NEW tokens, one batch-1 call per seed, against the target's
    exact distribution by enumeration (chi-square, helpers.stats' floor). A rollback that skips the states' copy
    (p = 3e-12 Mamba2, 1e-44 Granite hybrid) or drops the kept tokens (6e-12, 1e-29) fails; an uncropped attention
    K/V (p = 4e-3 here) is held by the greedy test above, as are re-runs past gamma + 1 (4+ tokens). Batch 1 makes
    this one call per sample: ~4 s each, the fewest rows that fail those mutants by a wide margin."""
    target = _sharp(make, layers)
    draft = perturbed(target, 0.5)
    prompt = torch.tensor([[1, 4, 3, 5]])
    _, probs = continuation_probs(target, prompt, hf_warpers(1.0, 0, 1.0))
    codes = []
    for seed in range(SAMPLING_ROWS):
        out = sk.generate(target, prompt, draft_model=draft, num_speculative_tokens=2, do_sample=True,
                          max_new_tokens=NEW, pad_token_id=0, seed=seed)
        codes.append(int((out[0, prompt.shape[1]:] * SAMPLING_VOCAB ** torch.arange(NEW - 1, -1, -1)).sum()))
    assert_matches(np.bincount(codes, minlength=SAMPLING_VOCAB**NEW), probs)


def _eager_experts(model):
    """Qwen3-Next's experts as plain matmuls: grouped_mm takes no float64, which the exact reference runs in."""
    if getattr(model.config, "num_experts", 0):
        model.set_experts_implementation("eager")
    return model


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("make", [mamba2_ssm, granite_hybrid, qwen3_next, lfm2])
def test_greedy_as_accurate_as_hf_in_half_precision(make, dtype):
    """The project's half-precision promise (``test_half_precision``): every token the argmax of its logits, those
    within twice HF's own error of the exact (float64) ones. Mamba2's chunked scan rounds otherwise than its
    one-token update (docs/half_precision.md): this prompt's bfloat16 and float16 Mamba2 runs part from
    model.generate at a near-tie, within the bound. A rollback that skips the states' copy fails it."""
    target = _eager_experts(make().to(dtype))
    ids = _prompt(9, 2)
    try:  # (as test_half_precision's _target: torch's CPU SDPA in half precision needs AVX-512 in torch 2.13)
        _expected(target, ids, 2)
    except RuntimeError as error:
        pytest.skip(f"torch cannot run {type(target).__name__} in {dtype} here: {error}")
    stats = sk.SpeculationStats()
    output = sk.generate(target, ids, attention_mask=torch.ones_like(ids), draft_model=perturbed(target, 0.3),
                         num_speculative_tokens=3, max_new_tokens=24, do_sample=False, pad_token_id=0,
                         eos_token_id=None, output_logits=True, return_dict_in_generate=True, speculation_stats=stats)
    assert stats.acceptance_rate < 1  # rollbacks ran in half precision
    assert_as_accurate_as_hf(target, output, ids, torch.ones_like(ids))


@pytest.mark.parametrize("target_is_recurrent", [False, True])
def test_mixed_pairs_and_prefill_chunks(target_is_recurrent):
    """A Mamba2 draft of a Llama target, a Llama draft of a hybrid target (each runner rolls back its own way),
    the prompt prefilled in chunks of 3 (forwards of several tokens continuing the state)."""
    recurrent, attention = mamba2(), llama(seed=5)
    target, draft = (granite_hybrid(), attention) if target_is_recurrent else (attention, recurrent)
    ids = _prompt(8, 4)
    stats = sk.SpeculationStats()
    got = sk.generate(target, ids, attention_mask=torch.ones_like(ids), draft_model=draft, num_speculative_tokens=2,
                      max_new_tokens=10, do_sample=False, pad_token_id=0, prefill_chunk_size=3,
                      speculation_stats=stats)
    assert torch.equal(got, _expected(target, ids, 10))
    assert stats.acceptance_rate < 1.0


def test_prefill_chunks_on_a_model_with_state_layers_only(monkeypatch):
    """prefill_chunk_size on Mamba2 (reading its SSM state): HF's own chunked prefill fails there (5.24 positions the
    chunks by cache.get_seq_length(), which a cache without attention layers refuses; 5.17 looks for
    past_key_values, where Mamba2 passes cache_params), so ours, each chunk continuing the state, is held to
    model.generate's unchunked tokens, and to its own unchunked run's logits."""
    target = mamba2_ssm()
    widths = []
    forward = RecurrentRunner.forward

    def recorded(runner, tokens, *args, prompt=False, **kwargs):
        if prompt and runner.model is target:
            widths.append(tokens.shape[1])
        return forward(runner, tokens, *args, prompt=prompt, **kwargs)

    monkeypatch.setattr(RecurrentRunner, "forward", recorded)
    ids = _prompt(10, 4)
    runs = {}
    for chunk in (3, None):
        runs[chunk] = sk.generate(target, ids, attention_mask=torch.ones_like(ids), draft_model=perturbed(target, 0.3),
                                  num_speculative_tokens=2, max_new_tokens=12, do_sample=False, pad_token_id=0,
                                  prefill_chunk_size=chunk, output_logits=True, return_dict_in_generate=True)
    assert widths == [3, 3, 3, 9]  # (the prompt but its last token, which the first verification feeds)
    assert torch.equal(runs[3].sequences, _expected(target, ids, 12))
    torch.testing.assert_close(torch.stack(runs[3].logits), torch.stack(runs[None].logits))


@pytest.mark.parametrize("make", [granite_hybrid_ssm, zamba2, nemotron_h])
def test_what_users_pass_is_as_model_generate_does_it(make):
    """Edge cases a user meets, on a hybrid reading its SSM state, each against model.generate: one and two new
    tokens, an EOS inside an accepted block, scores and logits, a streamer, the n-gram drafter, "auto" gamma, settings
    from the model's generation_config; and a Qwen3-Next draft of a Llama target. Found none different (5.24 and
    5.17, with Mamba2, Qwen3-Next and LFM2 targets too); held here on the Granite hybrid, and on Zamba2 and Nemotron-H
    whose dt falls under their time_step_limit (``test_recurrent_step_size``: the first token from the prompt's
    forward, the limit lifted after it)."""
    from transformers.generation.streamers import BaseStreamer

    class Recorder(BaseStreamer):
        def __init__(self):
            self.puts = []

        def put(self, value):
            self.puts += value.reshape(-1).tolist()

        def end(self):
            self.puts.append("end")

    target = make()
    target.generation_config.eos_token_id = None
    draft = dict(draft_model=perturbed(target, 0.3), num_speculative_tokens=3)
    ids = _prompt(9, 2)
    plain = _expected(target, ids, 20)[0, 9:].tolist()

    def check(model, hf_kwargs, ours_kwargs, new=16):
        kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False, pad_token_id=0,
                      **hf_kwargs)
        return model.generate(ids, **kwargs), sk.generate(model, ids, **kwargs, **ours_kwargs)

    assert torch.equal(*check(target, {}, draft, 1))
    assert torch.equal(*check(target, {}, dict(prompt_lookup_num_tokens=3), 2))
    stops = check(target, dict(eos_token_id=plain[6]), draft)
    assert torch.equal(*stops) and stops[0].shape[1] < 9 + 16
    hf, ours = check(target, dict(return_dict_in_generate=True, output_scores=True, output_logits=True,
                                  repetition_penalty=1.3), draft)
    assert torch.equal(hf.sequences, ours.sequences)
    torch.testing.assert_close(torch.stack(ours.scores), torch.stack(hf.scores))
    torch.testing.assert_close(torch.stack(ours.logits), torch.stack(hf.logits))
    streamer = Recorder()
    hf, ours = check(target, {}, dict(streamer=streamer, **draft))
    assert torch.equal(hf, ours) and streamer.puts == ours[0].tolist() + ["end"]
    assert torch.equal(*check(target, {}, dict(drafter=sk.NGramDrafter.for_model(target))))
    assert torch.equal(*check(target, {}, dict(draft_model=draft["draft_model"], num_speculative_tokens="auto"), 30))
    target.generation_config.update(max_new_tokens=11, no_repeat_ngram_size=2, eos_token_id=plain[8], pad_token_id=0)
    assert torch.equal(target.generate(ids, attention_mask=torch.ones_like(ids)),
                       sk.generate(target, ids, attention_mask=torch.ones_like(ids), **draft))
    if make is granite_hybrid_ssm:
        assert torch.equal(*check(llama(vocab=VOCAB, seed=5), {}, dict(draft_model=qwen3_next(),
                                                                       num_speculative_tokens=3)))


def test_one_host_read_per_iteration(monkeypatch):
    """The restore and the re-run take their counts from the iteration's one read (kept_host)."""
    target = mamba2()
    reads = count_reads_per_loop_step(monkeypatch)
    ids = _prompt()
    sk.generate(target, ids, draft_model=perturbed(target, 0.3), num_speculative_tokens=3, max_new_tokens=14,
                do_sample=False, pad_token_id=0)
    assert len(reads) > 2 and all(r == ["tolist"] for r in reads[1:]), reads


@pytest.mark.parametrize("path,batch,match", [
    ("dynamic", 2, "batch size 1 only"),
    ("static", 1, "dynamic cache only"),
    ("compile", 1, "dynamic cache only"),
])
def test_batches_and_the_static_cache_are_refused_by_name(path, batch, match):
    with pytest.raises(ValueError, match=rf"Mamba2ForCausalLM.*\['linear_attention'\] layers.*{match}"):
        check_model(mamba2(), path=path, batch=batch)


def test_mamba_is_refused_for_its_scan_restarting_from_zero():
    """transformers' Mamba mixer runs a forward of several tokens from a zero SSM state, whatever the cache holds:
    a verification forward could not continue it."""
    model = _build(MambaForCausalLM, MambaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2))
    with pytest.raises(ValueError, match="MambaForCausalLM.*selective scan from a zero state"):
        check_model(model)


def test_sliding_window_attention_beside_states_is_refused_by_name():
    """LFM3's default layout puts sliding-window attention layers beside its conv layers: HF's cache keeps only the
    window's last K/V there, which a rollback's crop to a slot (``crop_attention``) would cut wrongly. No test held
    the refusal (a mutant without it passed)."""
    config_class = getattr(transformers, "Lfm3Config", None)
    if config_class is None:
        pytest.skip("no LFM3 in this transformers")
    config = config_class(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                          num_attention_heads=4, num_key_value_heads=2, sliding_window=4, pad_token_id=0,
                          layer_types=["conv", "sliding_attention", "full_attention"], bos_token_id=1, eos_token_id=2)
    with pytest.raises(ValueError, match=r"Lfm3ForCausalLM.*\['conv'\] layers.*\['sliding_attention'\]"):
        check_model(transformers.Lfm3ForCausalLM(config))


def test_a_padded_prompt_is_refused_by_name():
    target = mamba2()
    ids = _prompt()
    mask = torch.ones_like(ids)
    mask[0, 0] = 0
    with pytest.raises(ValueError, match="attention_mask masks tokens.*Mamba2ForCausalLM.*recurrent state"):
        sk.generate(target, ids, attention_mask=mask, prompt_lookup_num_tokens=2, max_new_tokens=4, pad_token_id=0)


def test_an_early_exit_view_without_attention_layers_is_refused_by_name():
    """assistant_early_exit=1 on Qwen3-Next drafts with its first (gated DeltaNet) layer alone, whose forward reads
    the cache length from an attention layer there is none of: transformers failed inside (model.generate fails on
    such a model too). A Mamba2 view, which reads no cache length, is exact."""
    target = qwen3_next()
    ids = _prompt()
    with pytest.raises(ValueError, match=r"Qwen3NextForCausalLM.*no attention layer.*get_seq_length"):
        sk.generate(target, ids, assistant_early_exit=1, max_new_tokens=6, do_sample=False, pad_token_id=0)
    target = mamba2()
    got = sk.generate(target, ids, assistant_early_exit=1, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(got, _expected(target, ids, 8))


def test_a_prompt_cache_is_refused_by_name():
    """A DynamicCache holding the state after the prompt's first tokens (HF's prompt-cache recipe): its linear layers
    hold no K/V, so it was taken for an empty cache, the whole prompt prefilled and the caller's cache silently left
    as it was (model.generate continues from it and extends it)."""
    target = mamba2()
    ids = _prompt(8)
    with torch.no_grad():
        out = target(ids[:, :5], use_cache=True)
    if out.get("cache") is None:  # (transformers 5.17-5.23 return it as cache_params, model.generate's name there)
        with pytest.raises(ValueError, match=r"cache_params \(a cache of the prompt's first tokens"):
            sk.generate(target, ids, cache_params=out.cache_params, prompt_lookup_num_tokens=2, max_new_tokens=4,
                        pad_token_id=0)
        return
    with pytest.raises(ValueError, match=r"cache \(a cache of the prompt's first tokens\).*Mamba2ForCausalLM"):
        sk.generate(target, ids, cache=out.cache, prompt_lookup_num_tokens=2, max_new_tokens=4, pad_token_id=0)


def test_a_recurrent_draft_with_another_tokenizer_is_refused_by_name():
    """The re-tokenizing drafter may drop draft tokens fed in earlier iterations (its text re-tokenized), past the
    marks a recurrent runner keeps (the current iteration's)."""
    from helpers.tiny_tokenizers import char_tokenizer, permuted, permutation

    chars = "abcdefghij "
    target_tok = char_tokenizer(chars)
    draft_tok = permuted(target_tok, permutation(len(chars), seed=3), extra=("X",))
    target = llama(vocab=len(chars))
    draft = _build(Mamba2ForCausalLM, Mamba2Config(vocab_size=len(chars) + 1, hidden_size=32, num_hidden_layers=1,
                                                   num_heads=8, head_dim=8, state_size=8, expand=2, n_groups=1,
                                                   chunk_size=4))
    ids = target_tok("bcd", return_tensors="pt").input_ids
    with pytest.raises(ValueError, match=r"draft_model \(Mamba2ForCausalLM\) keeps recurrent states.*tokenizer"):
        sk.generate(target, ids, assistant_model=draft, tokenizer=target_tok, assistant_tokenizer=draft_tok,
                    max_new_tokens=4, num_speculative_tokens=2, pad_token_id=0)


def test_a_padded_prompt_with_a_recurrent_draft_is_refused_by_name():
    """A Llama target takes the padded prompt; the Mamba2 draft's state would take the pads: refused, naming it."""
    ids = _prompt()
    mask = torch.ones_like(ids)
    mask[0, 0] = 0
    with pytest.raises(ValueError, match="attention_mask masks tokens.*Mamba2ForCausalLM.*recurrent state"):
        sk.generate(llama(), ids, attention_mask=mask, draft_model=mamba2(), num_speculative_tokens=2,
                    max_new_tokens=4, pad_token_id=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("make", [mamba2_ssm, granite_hybrid_ssm, qwen3_next_ssm, lfm2])
def test_greedy_on_cuda_is_token_identical(make):
    """The runner on a CUDA device (transformers' hub kernels where it has them, else its torch fallbacks, which the
    CPU tests run): a perturbed recurrent draft and prompt lookup, against model.generate on the same device."""
    target = make().cuda()
    for seed, kwargs in ((0, dict(draft_model=perturbed(target, 0.3).cuda(), num_speculative_tokens=3)),
                         (1, dict(prompt_lookup_num_tokens=2))):
        ids = _prompt(7 + seed, seed).cuda()
        got = sk.generate(target, ids, attention_mask=torch.ones_like(ids), max_new_tokens=14, do_sample=False,
                          pad_token_id=0, **kwargs)
        assert torch.equal(got, _expected(target, ids, 14))
