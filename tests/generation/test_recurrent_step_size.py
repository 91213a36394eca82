"""Mamba2 mixers whose chunked scan clamps the SSM step size dt (``time_step_limit``) where their one-token step does
not (``step_size.py``). A target with a bounded limit (Zamba2's and Nemotron-H's (time_step_min, inf); Mamba2 with an
upper bound) is exact: its prompt's forwards clamp, as model.generate's prefill, its first token comes from them, and
every later forward lifts the limit. Greedy tokens are model.generate's with its logits, sampling follows its
distribution, and each of the two halves of the design is needed on these models (the clamp binds: without the lift,
or with the last prompt token in a lifted verification, the logits differ far beyond float error). A mixer the lift
cannot reach is refused by name."""

import contextlib

import numpy as np
import pytest
import torch
from transformers import (
    DynamicCache,
    Mamba2Config,
    Mamba2ForCausalLM,
    NemotronHConfig,
    NemotronHForCausalLM,
    Zamba2Config,
    Zamba2ForCausalLM,
)
from transformers.models.zamba2.modeling_zamba2 import Zamba2MambaMixer

import speculative_kernels as sk
from speculative_kernels.generation import loop as loop_module
from speculative_kernels.generation import step_size
from speculative_kernels.generation.capabilities import cache_argument
from speculative_kernels.generation.runners import recurrent
from helpers.host_reads import count_reads_per_loop_step
from helpers.models import perturbed
from helpers.sampling import NEW, hf_warpers
from helpers.sampling import VOCAB as SAMPLING_VOCAB
from helpers.stats import assert_matches

VOCAB = 97
# The largest difference of our logits from model.generate's, relative to its largest logit: the recurrent tests'
# tolerance (1e-4), over the float error of the scan against the steps (measured 2e-6 to 7e-6 on these models, 5.17
# and 5.24). _DIFFERS, ten times it: what the mutants of ``test_without_the_lift...`` must exceed (measured 1.4e-3
# to 1.8 at the seeds used there).
_EXACT, _DIFFERS = 1e-4, 1e-3


def _state_heavy(model, bounded: bool):
    """``model`` reading its SSM state (skip D zeroed, larger weights set by its config), so that dt values the
    clamp changes change its logits; bounded: False sets every mixer's time_step_limit to (0, inf)."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(getattr(module, "D", None), torch.nn.Parameter):
                module.D.zero_()
            if not bounded and hasattr(module, "time_step_limit"):
                module.time_step_limit = (0.0, float("inf"))
    return model


def zamba2(bounded: bool = True, seed: int = 0, vocab: int = VOCAB, time_step_min: float = 1e-3):
    """A tiny Zamba2 (a Mamba2 layer, then a hybrid one with shared attention) with time_step_min 0.001, its
    default, under which up to half its dt values fall (time_step_min=0 itself fails in Zamba2's weight
    initialisation: log(0))."""
    config = Zamba2Config(
        vocab_size=vocab, hidden_size=32, num_hidden_layers=2, layers_block_type=["mamba", "hybrid"],
        mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_ngroups=1, n_mamba_heads=8, mamba_headdim=8,
        chunk_size=4, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, attention_head_dim=8,
        num_mem_blocks=1, use_shared_attention_adapter=False, use_mem_rope=False, time_step_min=time_step_min,
        initializer_range=0.2, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    return _state_heavy(Zamba2ForCausalLM(config).eval(), bounded)


def nemotron_h(bounded: bool = True, seed: int = 0):
    """A tiny Nemotron-H (Mamba2, attention, Mamba2, MLP layers) with time_step_min 0.001, its default."""
    config = NemotronHConfig(
        vocab_size=VOCAB, hidden_size=32, layers_block_type=["mamba", "attention", "mamba", "mlp"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=64, ssm_state_size=8,
        mamba_num_heads=8, mamba_head_dim=8, n_groups=1, conv_kernel=4, expand=2, chunk_size=4, time_step_min=1e-3,
        initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    return _state_heavy(NemotronHForCausalLM(config).eval(), bounded)


def mamba2_capped(bounded: bool = True, seed: int = 0):
    """A tiny Mamba2 whose config bounds dt above (time_step_limit=(0, 0.01); Mamba2's default clamps nothing)."""
    config = Mamba2Config(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_heads=8, head_dim=8,
                          state_size=8, expand=2, n_groups=1, chunk_size=4, time_step_limit=(0.0, 0.01),
                          initializer_range=0.2, tie_word_embeddings=False)
    torch.manual_seed(seed)
    return _state_heavy(Mamba2ForCausalLM(config).eval(), bounded)


FAMILIES = [zamba2, nemotron_h, mamba2_capped]


def _prompt(seed: int, length: int = 8):
    return torch.randint(3, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))


def _greedy(ids, new: int = 16) -> dict:
    return dict(attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False, pad_token_id=0,
                eos_token_id=None, return_dict_in_generate=True, output_logits=True)


def _difference(target, ids, new: int = 16, **kwargs) -> tuple[bool, float, sk.SpeculationStats]:
    """(our greedy tokens are model.generate's, the largest difference of the logits of the tokens both emitted
    (up to the first that differs) relative to model.generate's largest, the call's statistics)."""
    expected = target.generate(ids, **_greedy(ids, new))
    stats = sk.SpeculationStats()
    got = sk.generate(target, ids, speculation_stats=stats, **_greedy(ids, new), **kwargs)
    largest = 0.0
    for ours, theirs, token, their_token in zip(got.logits, expected.logits, got.sequences[0, ids.shape[1]:],
                                                 expected.sequences[0, ids.shape[1]:]):
        largest = max(largest, ((ours - theirs).abs().max() / theirs.abs().max()).item())
        if token != their_token:
            break
    return torch.equal(got.sequences, expected.sequences), largest, stats


def _drafted(target, seed: int) -> dict:
    return dict(draft_model=perturbed(target, 0.3, seed=seed + 1), num_speculative_tokens=3)


@pytest.mark.parametrize("make", FAMILIES)
def test_a_bounded_target_is_greedy_exact_through_rollbacks(make):
    """A perturbed copy as the draft (a bounded draft too), three models each: model.generate's tokens and logits,
    with rejected drafts (restores, kept tokens folded into the next verification)."""
    restores = 0
    for seed in range(3):
        target = make(seed=seed)
        same, largest, stats = _difference(target, _prompt(seed), **_drafted(target, seed))
        assert same and largest < _EXACT, (seed, largest)
        assert stats.accepted_tokens < stats.drafted_tokens  # rejections: the rollback ran
        restores += stats.drafted_tokens - stats.accepted_tokens
    assert restores > 0


@pytest.mark.parametrize("kwargs", [dict(prefill_chunk_size=3), dict(prompt_lookup_num_tokens=2),
                                    dict(length=1), dict(new=1), dict(num_speculative_tokens=6, defer=True)])
def test_prompt_chunks_lookup_one_token_prompts_and_re_runs_are_exact(kwargs, monkeypatch):
    """The variants that reach the prompt's forwards or the re-runs differently: a chunked prefill (chunks of 3:
    the last of 2 tokens), prompt lookup (no draft model; iterations with nothing proposed), a one-token prompt,
    max_new_tokens=1 (the prompt's forward alone), and re-runs of kept tokens in forwards of their own (the runner
    defers none: every partly rejected iteration re-runs)."""
    kwargs = dict(kwargs)
    length, new = kwargs.pop("length", 8), kwargs.pop("new", 16)
    if kwargs.pop("defer", False):
        init = recurrent.RecurrentRunner.__init__
        monkeypatch.setattr(recurrent.RecurrentRunner, "__init__",
                            lambda runner, *args, **named: init(runner, *args, **{**named, "defer": 0}))
    for make in (zamba2, nemotron_h):
        target = make(seed=1)
        ids = _prompt(1, length)
        drafts = {} if "prompt_lookup_num_tokens" in kwargs else _drafted(target, 1)
        same, largest, _ = _difference(target, ids, new, **{**drafts, **kwargs})
        assert same and largest < _EXACT, (make.__name__, largest)


@pytest.mark.parametrize("length, chunk", [(8, 7), (9, 2), (9, 4)])
def test_prompt_chunks_of_a_bounded_model_without_attention_never_leave_a_one_token_forward(length, chunk):
    """prefill_chunk_size on a capped Mamba2 (no attention layer: transformers' own chunked prefill fails, so the
    reference is model.generate's unchunked prefill): HF's order would end on a one-token chunk (L mod N = 1), which
    runs the mixer's unclamped step (logits 1.6 to 2.0 off, measured); the short chunk runs first instead (a first
    forward of one token runs the clamped scan), so tokens and logits are the unchunked ones."""
    target = mamba2_capped(seed=length + chunk)
    ids = _prompt(chunk, length)
    same, largest, _ = _difference(target, ids, 8, prompt_lookup_num_tokens=2, prefill_chunk_size=chunk)
    assert same and largest < _EXACT, largest


def test_prompt_chunks_of_one_token_are_refused_for_a_bounded_model_without_attention():
    """prefill_chunk_size=1 leaves every prompt token but the first to the unclamped one-token step: refused by name
    (a one-token prompt, where model.generate too runs one forward, is not)."""
    target, ids = mamba2_capped(seed=1), _prompt(1)
    with pytest.raises(ValueError, match=r"prefill_chunk_size=1 cannot run Mamba2ForCausalLM.*time_step_limit"):
        sk.generate(target, ids, prompt_lookup_num_tokens=2, prefill_chunk_size=1, **_greedy(ids, 4))
    same, _, _ = _difference(target, ids[:, :1], 4, prompt_lookup_num_tokens=2, prefill_chunk_size=1)
    assert same


@pytest.mark.parametrize("make", [zamba2, nemotron_h])
def test_prompt_chunks_of_a_bounded_hybrid_are_model_generates_own(make):
    """Zamba2 and Nemotron-H (attention layers: transformers runs their chunked prefill) keep HF's chunk order, a
    last chunk of one token included: model.generate(prefill_chunk_size=7) over 8 tokens runs that token through
    the unclamped step as ours does (its logits differ from the unchunked ones by 1.4e-3 to 6.3e-3, measured)."""
    target, ids = make(seed=0), _prompt(0)
    options = dict(_greedy(ids, 8), prefill_chunk_size=7)
    expected = target.generate(ids, **options)
    got = sk.generate(target, ids, **options, **_drafted(target, 0))
    assert torch.equal(got.sequences, expected.sequences)
    largest = max(((ours - theirs).abs().max() / theirs.abs().max()).item()
                  for ours, theirs in zip(got.logits, expected.logits))
    assert largest < _EXACT, largest


@pytest.mark.parametrize("make", FAMILIES)
def test_without_the_lift_or_with_the_last_prompt_token_lifted_the_logits_differ(make, monkeypatch):
    """Why both halves are needed, and that the clamp binds on the models above (so their tests can fail): with the
    limit kept on the forwards after the prompt, or with the first token drawn from a verification over [the
    prompt's last token, drafts] (the last prompt token lifted, where model.generate's prefill clamps it), the
    logits differ from model.generate's far beyond float error on the same models and prompts (seeds 0 and 2 of the
    exactness test above; measured: kept limit 2.5e-2 Zamba2, 7.2e-3 Nemotron-H, 1.5 Mamba2; last prompt token
    lifted 1.4e-2, 1.4e-3, 1.8)."""
    def largest_difference():
        return max(_difference(target, _prompt(seed), **_drafted(target, seed))[1]
                   for seed in (0, 2) for target in [make(seed=seed)])

    with monkeypatch.context() as patched:
        patched.setattr(recurrent, "unbounded_step_size", lambda mixers: contextlib.nullcontext())
        assert largest_difference() > _DIFFERS
    with monkeypatch.context() as patched:
        init = loop_module.SpeculativeLoop.__init__
        patched.setattr(loop_module.SpeculativeLoop, "__init__",
                        lambda loop, *args, **named: init(loop, *args, **{**named, "first_token_from_prompt": False}))
        assert largest_difference() > _DIFFERS


def test_a_bounded_draft_beside_an_unbounded_target_is_exact():
    """Only the target's forwards must match model.generate's: a bounded draft is allowed (it lifts its limit after
    its prompt too, which changes only what it proposes)."""
    target = zamba2(bounded=False, seed=2)
    same, largest, stats = _difference(target, _prompt(2), draft_model=zamba2(seed=12), num_speculative_tokens=3)
    assert same and largest < _EXACT
    assert stats.accepted_tokens < stats.drafted_tokens


def test_the_limit_is_restored_after_every_forward_and_when_one_raises(monkeypatch):
    """The lift is for one forward: after a call the mixers hold their own limit objects again, and a forward that
    raises (here the second verification) leaves them restored too. (Prompt lookup: the target's mixers alone run.)"""
    target = zamba2(seed=3)
    mixers = step_size.bounded_mixers(target)
    limits = [mixer.time_step_limit for mixer in mixers]
    assert len(mixers) == 2 and limits[0] == (1e-3, float("inf"))
    lookup = dict(prompt_lookup_num_tokens=2)
    sk.generate(target, _prompt(3), **_greedy(_prompt(3), 6), **lookup)
    assert all(mixer.time_step_limit is limit for mixer, limit in zip(mixers, limits))
    calls, forward = [], Zamba2MambaMixer.forward

    def failing(mixer, *args, **kwargs):
        calls.append(mixer.time_step_limit)
        if len(calls) > 4:  # (two mixers: the prompt's forward, the first verification, then this one)
            raise RuntimeError("a forward that fails")
        return forward(mixer, *args, **kwargs)

    monkeypatch.setattr(Zamba2MambaMixer, "forward", failing)
    with pytest.raises(RuntimeError, match="a forward that fails"):
        sk.generate(target, _prompt(3), **_greedy(_prompt(3), 6), **lookup)
    assert calls[:2] == limits and calls[2:] == [step_size.UNBOUNDED] * 3  # prompt clamped, verifications lifted
    assert all(mixer.time_step_limit is limit for mixer, limit in zip(mixers, limits))


def test_the_lift_leaves_another_threads_forwards_of_the_same_model_alone():
    """The lift is the lifting thread's: while thread A's speculative call is held inside one of its lifted
    forwards, thread B's model.generate on the same model (which HF allows) runs its prompt through the clamped scan,
    so both outputs are those each gives alone, logits included. (The lift set the mixers' own attribute for the
    forward: B's prefill ran lifted, its logits 1.5e-2 of their scale off, measured; silently other tokens where a
    near-tie falls.)"""
    from helpers.threads import run_while_held

    target = zamba2(seed=6)
    draft = perturbed(target, 0.3, seed=7)
    ids_a, ids_b = _prompt(6), _prompt(7)
    run_a = lambda: sk.generate(target, ids_a, draft_model=draft, num_speculative_tokens=3, **_greedy(ids_a, 8))
    run_b = lambda: target.generate(ids_b, **_greedy(ids_b, 8))
    expected_a, expected_b = run_a(), run_b()
    mixer = step_size.bounded_mixers(target)[0]
    # (held in A's first forward after the prompt, its lift in place)
    out = run_while_held(mixer, run_a, run_b, holds=lambda module: module.time_step_limit == step_size.UNBOUNDED)
    for name, expected in (("b", expected_b), ("a", expected_a)):
        got = out[name]
        largest = max(((ours - theirs).abs().max() / theirs.abs().max()).item()
                      for ours, theirs in zip(got.logits, expected.logits))
        assert torch.equal(got.sequences, expected.sequences) and largest == 0.0, (name, largest)


def test_the_lift_nests_overlaps_across_threads_and_leaves_the_mixer_as_it_was():
    """``unbounded_step_size`` itself: (0, inf) in the lifting thread alone, through a nested lift and a lift of the
    same mixer by another thread that ends first (a draft sharing the target's modules, two calls on one model);
    a write meanwhile is kept; a deepcopy or pickle meanwhile is of the mixer's own class; afterwards the mixer's
    class, attributes and state_dict are those before."""
    import copy
    import pickle
    import threading

    mixer = step_size.bounded_mixers(zamba2(seed=3))[0]
    own_class, own, state = type(mixer), dict(vars(mixer)), mixer.state_dict()
    limit, reads = mixer.time_step_limit, {}
    b_lifted, a_done = threading.Event(), threading.Event()

    def other_thread():
        reads["outside"] = mixer.time_step_limit
        with step_size.unbounded_step_size([mixer]):
            b_lifted.set()
            a_done.wait(60)
            reads["after A's lift"] = mixer.time_step_limit

    thread = threading.Thread(target=other_thread)
    try:
        with step_size.unbounded_step_size([mixer]):
            thread.start()
            b_lifted.wait(60)
            with step_size.unbounded_step_size([mixer]):
                assert mixer.time_step_limit == step_size.UNBOUNDED
            assert mixer.time_step_limit == step_size.UNBOUNDED and type(copy.deepcopy(mixer)) is own_class
            assert type(pickle.loads(pickle.dumps(mixer))) is own_class
        assert mixer.time_step_limit is limit  # (B's lift runs on: ours ended)
    finally:
        a_done.set()
        thread.join(60)
    assert reads == {"outside": limit, "after A's lift": step_size.UNBOUNDED}
    assert type(mixer) is own_class and vars(mixer).keys() == own.keys()
    assert all(vars(mixer)[name] is value for name, value in own.items())
    assert all(torch.equal(value, mixer.state_dict()[name]) for name, value in state.items())
    with step_size.unbounded_step_size([mixer]):
        mixer.time_step_limit = (0.01, 1.0)
        assert mixer.time_step_limit == step_size.UNBOUNDED
    assert mixer.time_step_limit == (0.01, 1.0)


def test_one_host_read_per_iteration(monkeypatch):
    """The first iteration (the prompt's forward, no draft) and the verifications read the host once each."""
    target = zamba2(seed=4)
    reads = count_reads_per_loop_step(monkeypatch)
    sk.generate(target, _prompt(4), **_greedy(_prompt(4), 12), **_drafted(target, 4))
    assert len(reads) > 2 and all(r == ["tolist"] for r in reads[1:]), reads


def test_the_statistics_count_the_prompts_forward_as_a_target_forward():
    """The first token comes from the target's forward over the prompt: that forward is a target forward that
    drafted nothing (a row-step at n = 0), not a prefill forward (README's statistics paragraph)."""
    target, ids = zamba2(seed=4), _prompt(4)
    stats = sk.SpeculationStats()
    sk.generate(target, ids, speculation_stats=stats, **_greedy(ids, 12), **_drafted(target, 4))
    assert stats.prefill_forwards == 0 and stats.new_tokens == 12
    assert stats.target_forwards == sum(stats.accepted_histogram) and stats.accepted_histogram[0] >= 1
    assert stats.new_tokens == sum((n + 1) * count for n, count in enumerate(stats.accepted_histogram))


def _refused_as_target(mixer_class, message: str):
    """A bounded Zamba2 whose mixers are of ``mixer_class``, refused as a target with ``message``; (it, its prompt)."""
    target = zamba2(seed=5)
    for mixer in step_size.bounded_mixers(target):
        mixer.__class__ = mixer_class
    ids = _prompt(5)
    with pytest.raises(ValueError, match=message):
        sk.generate(target, ids, prompt_lookup_num_tokens=3, **_greedy(ids))
    return target, ids


def test_a_mixer_that_does_not_read_its_limit_is_refused_by_name():
    """A mixer class whose forward does not pass dt_limit=self.time_step_limit to its scan (here a subclass that
    wraps it) would not see the lift: refused as a target, by the class and the limit; allowed as a draft."""
    class WrappedMixer(Zamba2MambaMixer):
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)

    target, ids = _refused_as_target(WrappedMixer, r"Zamba2ForCausalLM.*time_step_limit=\(0\.001, inf\).*WrappedMixer")
    same, largest, _ = _difference(zamba2(bounded=False, seed=5), ids, draft_model=target, num_speculative_tokens=3)
    assert same and largest < _EXACT


def test_a_mixer_whose_class_defines_its_limit_is_refused_by_name():
    """A mixer class that defines time_step_limit itself (here a property) would have it replaced, for every thread,
    by the lift's per-thread property, which answers the instance's value: refused as a target by the class and the
    limit."""
    class PropertyLimitMixer(Zamba2MambaMixer):
        time_step_limit = property(lambda mixer: mixer.__dict__["time_step_limit"])

    _refused_as_target(PropertyLimitMixer, r"time_step_limit=\(0\.001, inf\).*PropertyLimitMixer")


def _sharp_zamba2():
    """A Zamba2 over helpers.sampling's 6-token vocabulary with its output layer scaled x12 (a few continuations hold
    most of the mass), without EOS: a bounded target whose continuation distribution can be enumerated. Its
    time_step_min is 0.03, so that the clamp moves that distribution far (0.68 in total variation from that of one
    clamped forward over the continuations; with 0.001, the default, 1e-3 at most on three such models: no test of
    30 samples could see it, where the greedy tests above see it in the logits)."""
    model = zamba2(seed=9, vocab=SAMPLING_VOCAB, time_step_min=0.03)
    with torch.no_grad():
        model.lm_head.weight.mul_(12.0)
    model.generation_config.eos_token_id = None
    return model


def _step_probs(model, prompt, warpers=None) -> np.ndarray:
    """Exact probability of every NEW-token continuation of ``prompt`` [1, L] as model.generate samples it (through
    ``warpers``, HF's LogitsProcessorList, where given): the prompt in one forward (the clamped scan), then one token
    per forward (unclamped steps), every continuation a row. Returns [VOCAB**NEW] in itertools.product order."""
    rows = SAMPLING_VOCAB ** NEW
    codes = torch.arange(rows)
    seqs = torch.stack([(codes // SAMPLING_VOCAB ** (NEW - 1 - t)) % SAMPLING_VOCAB for t in range(NEW)], dim=1)
    name = cache_argument(model) or "cache_params"
    cache = DynamicCache(config=model.config)
    logp = torch.zeros(rows, dtype=torch.float64)
    with torch.no_grad():
        logits = model(input_ids=prompt.expand(rows, -1), use_cache=True, **{name: cache}).logits[:, -1]
        for t in range(NEW):
            if warpers is not None:
                logits = warpers(torch.cat([prompt.expand(rows, -1), seqs[:, :t]], dim=1), logits.float().clone())
            logp += torch.log_softmax(logits.double(), dim=-1).gather(1, seqs[:, t : t + 1]).squeeze(1)
            if t + 1 < NEW:
                logits = model(input_ids=seqs[:, t : t + 1], use_cache=True, **{name: cache}).logits[:, -1]
    return logp.exp().numpy()


SAMPLING_ROWS = 30  # one batch-1 generate call each


def test_sampled_continuations_follow_model_generate():
    """do_sample with a perturbed draft that is often rejected: whole continuations of NEW tokens, one batch-1 call
    per seed, against model.generate's exact distribution by enumeration (the prompt clamped, then one-token steps;
    chi-square, helpers.stats' floor; measured p = 0.13). A runner that keeps the limit after the prompt fails it
    (p = 9e-11); the last prompt token lifted moves this distribution too little for 30 samples (p = 0.13: the
    greedy tests hold that half)."""
    target = _sharp_zamba2()
    draft = perturbed(target, 0.5)
    prompt = torch.tensor([[1, 4, 3, 5]])
    probs = _step_probs(target, prompt)
    codes = []
    for seed in range(SAMPLING_ROWS):
        out = sk.generate(target, prompt, draft_model=draft, num_speculative_tokens=2, do_sample=True,
                          max_new_tokens=NEW, pad_token_id=0, seed=seed)
        codes.append(int((out[0, prompt.shape[1]:] * SAMPLING_VOCAB ** torch.arange(NEW - 1, -1, -1)).sum()))
    assert_matches(np.bincount(codes, minlength=SAMPLING_VOCAB**NEW), probs)


def test_sampled_continuations_with_warpers_follow_model_generate():
    """As above with temperature 1.3, top_k 4 and top_p 0.9: the first token, drawn from the prompt's forward by a
    verification with nothing proposed, and the verified drafts after it are warped as model.generate warps its
    steps (measured p = 0.038 over these 30 seeds, 0.38 over 400 others by script). A runner that keeps the limit
    after the prompt fails it (p = 4.5e-7)."""
    target = _sharp_zamba2()
    draft = perturbed(target, 0.5)
    prompt = torch.tensor([[1, 4, 3, 5]])
    probs = _step_probs(target, prompt, hf_warpers(1.3, 4, 0.9))
    codes = []
    for seed in range(SAMPLING_ROWS):
        out = sk.generate(target, prompt, draft_model=draft, num_speculative_tokens=2, do_sample=True,
                          temperature=1.3, top_k=4, top_p=0.9, max_new_tokens=NEW, pad_token_id=0, seed=seed)
        codes.append(int((out[0, prompt.shape[1]:] * SAMPLING_VOCAB ** torch.arange(NEW - 1, -1, -1)).sum()))
    assert_matches(np.bincount(codes, minlength=SAMPLING_VOCAB**NEW), probs)


def test_a_compiled_mixer_reads_the_lift_of_each_call_and_thread():
    """A model compiled by its user (``model.compile()``, ``torch.compile(model)``: HF allows it, and
    ``sk.generate`` runs such a model's compiled forwards) reads ``time_step_limit`` inside the traced code: dynamo
    must guard on what the lift's property answers, or a graph traced clamped would run lifted forwards clamped (other
    logits, silently), and one traced lifted would run another thread's forwards lifted. A compiled mixer gives the
    eager mixer's output bit for bit, clamped, lifted, in another thread during the lift, and after it. (Checked
    whole, 2026-11-28: a Zamba2 target after ``model.compile()`` or with its forward compiled, drafted by a
    perturbed copy, gave model.generate's tokens and logits to 2.5e-6 of their scale.)"""
    import threading

    mixer = step_size.bounded_mixers(zamba2(seed=3))[0]
    hidden = torch.randn(1, 6, 32, generator=torch.Generator().manual_seed(0))
    compiled = torch.compile(mixer, backend="eager")  # (dynamo's guards are the backend's whatever it is)
    with torch.no_grad():
        clamped = mixer(hidden)
        with step_size.unbounded_step_size([mixer]):
            lifted = mixer(hidden)
        assert (lifted - clamped).abs().max() > _DIFFERS * clamped.abs().max()  # (the clamp binds here)
        assert torch.equal(compiled(hidden), clamped)
        with step_size.unbounded_step_size([mixer]):
            assert torch.equal(compiled(hidden), lifted)
            other = []
            thread = threading.Thread(target=lambda: other.append(compiled(hidden)))
            thread.start()
            thread.join(120)
            assert len(other) == 1 and torch.equal(other[0], clamped)
        assert torch.equal(compiled(hidden), clamped)
