"""``seed=`` of ``generate`` and ``SpeculativeDecoder.start``: one int keys every random number of a call (draft
sampling and verification), replays it exactly, leaves torch's global generator alone, and does not bias the
sampled distribution; row b of a call draws with ``row_keys(seed)[b]`` for every batch size."""

import numpy as np
import pytest
import torch

import speculative_kernels as sk
from helpers.models import llama
from helpers.sampling import hf_warpers
from helpers.stats import assert_matches
from speculative_kernels.ops.randomness import DecodeRandomness, row_keys

VOCAB = 8
PROMPT = torch.tensor([[1, 4, 3, 5]])
SAMPLING = dict(do_sample=True, temperature=0.8, top_k=5, top_p=1.0, pad_token_id=0)


def spread(seed: int, layers: int):
    """A Llama over VOCAB tokens whose next-token distributions are spread out (no token above 0.3), without EOS, so
    that sampled outputs of different seeds differ with overwhelming probability; target and draft disagree."""
    model = llama(layers=layers, vocab=VOCAB, seed=seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    model.generation_config.eos_token_id = None
    return model


@pytest.fixture(scope="module")
def pair():
    return spread(0, 2), spread(7, 1)


def _generate(pair, prompt=PROMPT, **kwargs):
    target, draft = pair
    options = dict(SAMPLING, max_new_tokens=30, num_speculative_tokens=3) | kwargs
    return sk.generate(target, prompt, draft_model=draft, **options)


def test_same_seed_same_output_different_seeds_differ(pair):
    first, again, other = _generate(pair, seed=5), _generate(pair, seed=5), _generate(pair, seed=6)
    assert torch.equal(first, again)
    # 30 tokens, each from a distribution with no token above ~0.3: equal by chance with probability < 0.3**30.
    assert not torch.equal(first, other)


def test_seeded_call_leaves_the_global_generator_alone(pair):
    torch.manual_seed(123)
    state = torch.get_rng_state()
    out = _generate(pair, seed=9)
    assert torch.equal(torch.get_rng_state(), state)
    torch.manual_seed(0)  # the global generator's state does not enter a seeded call either
    assert torch.equal(_generate(pair, seed=9), out)


def test_unseeded_calls_draw_from_torch_generator(pair):
    """seed=None, the default: the seed is drawn from torch's generator, so torch.manual_seed makes runs repeatable."""
    torch.manual_seed(42)
    fresh = torch.get_rng_state()
    first = _generate(pair)
    assert not torch.equal(torch.get_rng_state(), fresh)
    torch.manual_seed(42)
    assert torch.equal(_generate(pair, seed=None), first)


@pytest.mark.parametrize("drafting", ["draft_model", "prompt_lookup"])
def test_greedy_calls_leave_the_global_generator_alone_as_hf_does(pair, drafting):
    """Nothing is random in greedy decoding: like model.generate, no seed is drawn, so the numbers a script draws
    after the call are the ones it would draw after model.generate."""
    target, draft = pair
    extra = dict(draft_model=draft) if drafting == "draft_model" else dict(prompt_lookup_num_tokens=3)
    torch.manual_seed(7)
    target.generate(PROMPT, max_new_tokens=6, do_sample=False, pad_token_id=0)
    after_hf = torch.get_rng_state()
    torch.manual_seed(7)
    sk.generate(target, PROMPT, max_new_tokens=6, do_sample=False, pad_token_id=0, **extra)
    assert torch.equal(torch.get_rng_state(), after_hf)


def test_row_keys_are_used_for_every_batch_size():
    for batch in (1, 3):
        randomness = DecodeRandomness(batch, torch.device("cpu"), seed=77)
        assert randomness.seed_per_row
        assert torch.equal(randomness.seed, row_keys(torch.full((batch,), 77, dtype=torch.int64)))


def test_row_zero_of_a_seeded_batch_is_the_seeded_batch_one_call(pair):
    """Row 0 of a batch with seed s is the batch-1 call with seed s, whole output included: each row is drafted at
    most its own tokens left less one, and its random-number offsets count its own draws, so its last iterations
    do not depend on the rows with more tokens left. The other rows differ from row 0 (their keys differ)."""
    new, gamma = 40, 3
    for seed in range(10, 22):
        batch = _generate(pair, PROMPT.expand(4, -1), seed=seed, max_new_tokens=new, num_speculative_tokens=gamma)
        alone = _generate(pair, seed=seed, max_new_tokens=new, num_speculative_tokens=gamma)
        assert torch.equal(batch[0], alone[0])
        for row in range(1, 4):
            assert not torch.equal(batch[row], batch[0])


def test_seeds_do_not_bias_the_first_token(pair):
    """The first token over many seeds follows the target's warped distribution (chi-square). With
    max_new_tokens=2 and gamma 1 it comes out of verification: an accepted draft or a residual sample. The seeds run
    as the requests of one SpeculativeDecoder, whose request with a seed gives generate's tokens with that seed
    (checked here on every 50th seed): the same 1000 draws, in about a quarter of the time of 1000 generate calls."""
    target, draft = pair
    with torch.no_grad():
        logits = target(PROMPT).logits[:, -1].double()
    warped = hf_warpers(SAMPLING["temperature"], SAMPLING["top_k"], SAMPLING["top_p"])(PROMPT, logits)
    probs = warped.softmax(-1)[0].numpy()
    seeds = 1000
    decoder = sk.SpeculativeDecoder(target, draft, num_speculative_tokens=1, max_batch_size=100)
    settings = {k: v for k, v in SAMPLING.items() if k != "pad_token_id"}
    requests = [decoder.add_request(PROMPT[0].tolist(), seed=seed, max_new_tokens=2, **settings)
                for seed in range(seeds)]
    while decoder.has_work():
        decoder.step()
    first = [decoder.result(request).token_ids[0] for request in requests]
    for seed in range(0, seeds, 50):
        alone = _generate(pair, seed=seed, max_new_tokens=2, num_speculative_tokens=1)[0, PROMPT.shape[1]]
        assert first[seed] == int(alone), seed
    assert_matches(np.bincount(first, minlength=VOCAB), probs)


def test_decoder_session_takes_the_seed(pair):
    target, draft = pair
    expected = _generate(pair, seed=21, max_new_tokens=12)
    session = sk.SpeculativeDecoder(target, draft, num_speculative_tokens=3).start(
        PROMPT, seed=21, max_new_tokens=12, **SAMPLING)
    while not session.finished:
        session.step()
    assert torch.equal(session.sequences(), expected)


@pytest.mark.parametrize("seed,error,message", [
    (True, TypeError, "seed must be an int or None, got bool"),
    (1.5, TypeError, "seed must be an int or None, got float"),
    ("3", TypeError, "seed must be an int or None, got str"),
    (torch.tensor(3), TypeError, "seed must be an int or None, got Tensor"),
    (-1, ValueError, r"seed must be in \[0, 2\*\*63\), got -1"),
    (2**63, ValueError, r"seed must be in \[0, 2\*\*63\), got 9223372036854775808"),
])
def test_bad_seeds_are_refused_by_name(pair, seed, error, message):
    target, draft = pair
    with pytest.raises(error, match=message):
        _generate(pair, seed=seed)
    with pytest.raises(error, match=message):
        sk.SpeculativeDecoder(target, draft).start(PROMPT, seed=seed, max_new_tokens=4)


def test_largest_seed_and_numpy_ints_are_accepted(pair):
    assert torch.equal(_generate(pair, seed=np.int64(3), max_new_tokens=5), _generate(pair, seed=3, max_new_tokens=5))
    assert _generate(pair, seed=2**63 - 1, max_new_tokens=5).shape == (1, PROMPT.shape[1] + 5)


def test_encoder_decoder_pairs_take_the_seed():
    from helpers.seq2seq_models import t5

    target, draft = t5(), t5(layers=1, seed=3)
    source = torch.tensor([[3, 4, 5, 3, 2], [7, 8, 9, 2, 0]])
    mask = (source != 0).long()
    runs = [sk.generate(target, source, attention_mask=mask, draft_model=draft, do_sample=True, max_new_tokens=12,
                        seed=seed) for seed in (8, 8, 9)]
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])


def test_greedy_requests_leave_the_global_generator_alone(pair):
    target, draft = pair
    decoder = sk.SpeculativeDecoder(target, draft, num_speculative_tokens=3)
    torch.manual_seed(3)
    state = torch.get_rng_state()
    decoder.add_request([1, 4, 3], max_new_tokens=5, do_sample=False)
    while decoder.has_work():
        decoder.step()
    assert torch.equal(torch.get_rng_state(), state)
