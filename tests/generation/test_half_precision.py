"""Half precision (bfloat16, float16): our greedy tokens and logits are as accurate as ``model.generate``'s.

Speculative decoding computes a token's logits in a forward of several tokens (the verification), ``model.generate``
in a forward of one. In half precision the two round differently -- some kernels split their sums by the number of
query rows (CPU: grouped-KV SDPA attention, float16 and bfloat16 matmuls on some inputs; GPU: split-KV decode
attention, GEMM tiles) -- so at a near-tie the greedy token can differ from ``model.generate``'s, as it does between
HF's own plain, batched and static-cache ``generate`` (``docs/half_precision.md``). Bit-identity to
``model.generate`` is therefore not the test in half precision; accuracy is, derived as in ``helpers/float_error.py``
from HF's own error against the exact (float64) logits, along the tokens we produced:

* each token we emit is the argmax of the logits we return for it;
* those logits are within twice HF's own error of the exact ones (HF's error: the larger of a one-token-step forward
  and one teacher-forced forward in the model's dtype, on the same tokens).

Together they bound how much better any token HF might have chosen instead can be (in exact logits: at most four
times HF's error), so a difference from ``model.generate`` can only be a near-tie, never a defect; a wrong position,
mask, cast or rollback moves the logits by their own scale and fails here.
"""

import copy

import pytest
import torch
import transformers

import speculative_kernels as sk
from speculative_kernels.generation.capabilities import check_model
from helpers.models import FAMILIES, perturbed
from helpers.prompts import left_padded

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
VOCAB, NEW, GAMMA = 256, 24, 4
# e_ref / max |logit| above this: the test model is too ill-conditioned in this dtype for a defect (which moves logits
# by their own scale) to stand out from rounding; the test model is at fault, not the code under test.
ILL_CONDITIONED = 0.05


@torch.no_grad()
def _reference_logits(model, exact_model, sequence: torch.Tensor, prompt_length: int):
    """For one row's ``sequence`` [1, L] (its prompt then the generated tokens): [L - prompt_length, V] logits that
    predicted each generated token, computed (1) as model.generate does (prompt prefill, then one-token steps),
    (2) by one teacher-forced forward in the model's dtype, (3) exactly (the float64 copy)."""
    from transformers import DynamicCache

    # past_key_values, or cache from 5.24 (Mamba2's cache_params before it: the spec's keyword, as the runners use)
    cache = {check_model(model).cache_argument: DynamicCache(config=model.config)}
    steps = [model(sequence[:, :prompt_length], **cache, use_cache=True).logits[0, -1]]
    for position in range(prompt_length, sequence.shape[1] - 1):
        steps.append(model(sequence[:, position:position + 1], **cache, use_cache=True).logits[0, -1])
    one_pass = model(sequence[:, :-1]).logits[0, prompt_length - 1:]
    exact = exact_model(sequence[:, :-1]).logits[0, prompt_length - 1:]
    return torch.stack(steps).double(), one_pass.double(), exact


def assert_as_accurate_as_hf(model, output, ids, mask) -> dict:
    """``output``: ``sk.generate(..., output_logits=True, return_dict_in_generate=True, eos_token_id=None)`` on the
    left-padded ``ids``/``mask`` [B, P]. Checks every row as the module docstring says; returns counts for the
    caller: steps checked, and steps where model.generate's one-token forward would have chosen another token."""
    exact_model = copy.deepcopy(model).double()
    counts = {"steps": 0, "other_choice": 0}
    ours_all = torch.stack(output.logits, dim=1).double()  # [B, NEW, V]
    for row in range(ids.shape[0]):
        prompt = ids[row, mask[row].bool()]
        sequence = torch.cat([prompt, output.sequences[row, ids.shape[1]:].to(prompt.device)])[None]
        new = sequence[0, len(prompt):]
        try:
            steps, one_pass, exact = _reference_logits(model, exact_model, sequence, len(prompt))
        except RuntimeError as error:  # HF's model alone, not our code: torch's kernel for this shape is missing here
            pytest.skip(f"torch cannot compute the reference logits on this machine: {error}")
        e_ref = max((steps - exact).abs().max().item(), (one_pass - exact).abs().max().item())
        scale = exact.abs().max().item()
        assert e_ref <= ILL_CONDITIONED * scale, f"ill-conditioned test model: e_ref {e_ref:.3g}, logits {scale:.3g}"
        ours = ours_all[row]
        assert torch.equal(ours.argmax(dim=-1).to(new.device), new), \
            f"row {row}: an emitted token is not the argmax of its logits"
        error = (ours.to(exact.device) - exact).abs().max().item()
        assert error <= 2 * e_ref, f"row {row}: logits off the exact ones by {error:.3g}, HF's own error {e_ref:.3g}"
        counts["steps"] += len(new)
        counts["other_choice"] += int((steps.argmax(dim=-1) != new).sum())
    return counts


def _target(family: str, dtype_name: str, attention: str = "sdpa", device: str = "cpu"):
    """The tiny model in ``dtype_name`` with ``attention``; skipped (naming torch's error) where this machine's torch
    cannot run that model at all (torch's CPU SDPA in bfloat16 needs AVX-512: "pack_vnni2 is only supported when
    avx512 is supported"), so model.generate fails there too."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model = FAMILIES[family](hidden=64, vocab=VOCAB).to(device=device, dtype=DTYPES[dtype_name])
    model.config._attn_implementation = attention
    ids, mask = (t.to(device) for t in left_padded([5, 9], seed=0))
    try:  # (torch picks its SDPA kernel by shape and mask: a masked batch and cached steps, as the tests run)
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
            model(ids, attention_mask=mask)
    except RuntimeError as error:
        pytest.skip(f"torch cannot run {family} in {dtype_name} with {attention} attention here: {error}")
    return model


@pytest.mark.parametrize("dtype_name", sorted(DTYPES))
@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("attention,device", [("sdpa", "cpu"), ("eager", "cpu"), ("sdpa", "cuda")])
def test_greedy_as_accurate_as_hf_in_half_precision(family, dtype_name, cache, attention, device):
    target = _target(family, dtype_name, attention, device)
    draft = perturbed(target, scale=0.3)
    ids, mask = (t.to(device) for t in left_padded([5, 9, 3], seed=4))
    stats = sk.SpeculationStats()
    output = sk.generate(target, ids, attention_mask=mask, draft_model=draft, num_speculative_tokens=GAMMA,
                         cache_implementation=cache, max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                         eos_token_id=None, output_logits=True, return_dict_in_generate=True,
                         speculation_stats=stats)
    assert 0 < stats.acceptance_rate < 1  # rejections happened: rollbacks ran in half precision
    assert_as_accurate_as_hf(target, output, ids, mask)


@pytest.mark.parametrize("dtype_name", sorted(DTYPES))
def test_prompt_lookup_as_accurate_as_hf_in_half_precision(dtype_name):
    target = _target("llama", dtype_name)
    ids, mask = left_padded([10, 12], seed=5)
    ids[:, -4:] = ids[:, -8:-4].clone()  # a repeat for the lookup to find (within both rows' real tokens)
    output = sk.generate(target, ids, attention_mask=mask, prompt_lookup_num_tokens=3, max_new_tokens=NEW,
                         do_sample=False, pad_token_id=0, eos_token_id=None, output_logits=True,
                         return_dict_in_generate=True)
    assert_as_accurate_as_hf(target, output, ids, mask)


def test_the_check_catches_a_position_defect():
    """The check itself fails on a defect that keeps greedy tokens plausible: logits one position off."""
    target = _target("llama", "bfloat16", "eager")
    ids, mask = left_padded([6], seed=7)
    output = sk.generate(target, ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                         eos_token_id=None, output_logits=True, return_dict_in_generate=True,
                         draft_model=perturbed(target, scale=0.3))
    assert_as_accurate_as_hf(target, output, ids, mask)
    shifted = copy.copy(output)
    shifted.logits = output.logits[1:] + output.logits[-1:]
    shifted.sequences = torch.cat([output.sequences[:, : ids.shape[1]],
                                   torch.stack([lg.argmax(-1) for lg in shifted.logits], dim=1)], dim=1)
    with pytest.raises(AssertionError, match="logits off the exact ones"):
        assert_as_accurate_as_hf(target, shifted, ids, mask)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_greedy_under_autocast_as_accurate_as_hf(family, cache):
    """A float32 model under ``torch.autocast`` computes in bfloat16: as accurate as model.generate under the same
    autocast (the references run under it too; the float64 copy is not cast). The static cache refused it: autocast
    makes K/V in bfloat16 (keys float32 again after rotary embeddings), which its float32 buffers' check took for an
    unsupported layout (a RuntimeError inside index_copy_ for Llama; 'this K/V layout is not supported' for GPT-2)."""
    target = FAMILIES[family](hidden=64, vocab=VOCAB)
    draft = perturbed(target, scale=0.3)
    ids, mask = left_padded([5, 9, 3], seed=4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        try:
            with torch.no_grad():
                target.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0,
                                cache_implementation=cache)
        except RuntimeError as error:
            # (HF's own static cache in 5.17-5.23: index_copy_ of bfloat16 K/V into its float32 buffers)
            pytest.skip(f"model.generate of transformers {transformers.__version__} cannot run {family} under "
                        f"bfloat16 autocast with the {cache} cache: {error}")
        stats = sk.SpeculationStats()
        output = sk.generate(target, ids, attention_mask=mask, draft_model=draft, num_speculative_tokens=GAMMA,
                             cache_implementation=cache, max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                             eos_token_id=None, output_logits=True, return_dict_in_generate=True,
                             speculation_stats=stats)
        assert 0 < stats.acceptance_rate < 1
        assert_as_accurate_as_hf(target, output, ids, mask)


@pytest.mark.parametrize("dtypes", [(torch.float16, torch.bfloat16), (torch.bfloat16, torch.float16)],
                         ids=["float16-under-bfloat16", "bfloat16-under-float16"])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_a_half_model_under_autocast_to_the_other_half_type(dtypes, cache):
    """A float16 model under CPU autocast (bfloat16 by default), or the reverse, runs in model.generate. Ours crashed
    inside torch on the dynamic cache (CPU autocast to bfloat16 fails on a cat of float16 masks) and the static cache
    refused the K/V (float32 keys after the rotary embedding, values in the autocast dtype, neither the model's):
    the masks are built outside autocast, and the static buffers hold such K/V in float32 (exact)."""
    model_dtype, autocast_dtype = dtypes
    target = FAMILIES["llama"](hidden=64, vocab=VOCAB).to(model_dtype)
    ids, mask = left_padded([5, 9, 3], seed=4)
    with torch.autocast("cpu", dtype=autocast_dtype):
        for drafting in (dict(draft_model=perturbed(target, scale=0.3), num_speculative_tokens=GAMMA),
                         dict(prompt_lookup_num_tokens=GAMMA)):
            output = sk.generate(target, ids, attention_mask=mask, max_new_tokens=NEW,
                                 cache_implementation=cache, do_sample=False, pad_token_id=0, eos_token_id=None,
                                 output_logits=True, return_dict_in_generate=True, **drafting)
            assert_as_accurate_as_hf(target, output, ids, mask)


def test_a_float32_draft_of_a_float16_target_keeps_its_logits():
    """The draft's logits were cast to the target's dtype: a float32 draft's logits past float16's 65504 became inf
    and the call failed naming draft_logits (HF's assisted generation runs). q is kept in the wider dtype now."""
    target = FAMILIES["llama"](vocab=VOCAB).half()
    draft = perturbed(FAMILIES["llama"](vocab=VOCAB)).float()
    with torch.no_grad():
        draft.lm_head.weight.mul_(1e6)  # logits of order 1e5: finite in float32 only
    ids = torch.tensor([[5, 9, 11, 20, 7]])
    expected = target.generate(ids, max_new_tokens=10, do_sample=False)
    assert torch.equal(sk.generate(target, ids, draft_model=draft, max_new_tokens=10, do_sample=False), expected)
    sampled = sk.generate(target, ids, draft_model=draft, max_new_tokens=10, do_sample=True, seed=0)
    assert sampled.shape == expected.shape


@pytest.mark.parametrize("dtypes", [(torch.float16, torch.bfloat16), (torch.bfloat16, torch.float16)],
                         ids=["float16-under-bfloat16", "bfloat16-under-float16"])
def test_a_request_joins_a_running_batch_under_autocast_to_the_other_half_type(dtypes):
    """Continuous batching (dynamic cache) of a half-precision model under CPU autocast to the other half type: a
    request joining the running batch crashed inside torch (the joined rows' masks were concatenated under the
    caller's autocast, which fails on a cat of float16 masks), ending every request with an error; model.generate
    runs each (found by the ambient-state hunt). Both requests now finish."""
    model_dtype, autocast_dtype = dtypes
    target = FAMILIES["llama"](vocab=VOCAB).to(model_dtype)
    with torch.autocast("cpu", dtype=autocast_dtype):
        decoder = sk.SpeculativeDecoder(target, perturbed(target, scale=0.3), num_speculative_tokens=3)
        first = decoder.add_request([5, 9, 11, 20], max_new_tokens=6, do_sample=False)
        decoder.step()  # running
        second = decoder.add_request([7, 8, 9], max_new_tokens=6, do_sample=False)
        while decoder.has_work():
            decoder.step()  # the second joins the running batch
    for request in (first, second):
        result = decoder.result(request)
        assert result.finish_reason == "length" and len(result.token_ids) == 6, result


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_a_session_keeps_the_autocast_it_was_started_under(cache):
    """Autocast is per thread: a session started under autocast (a request handler's thread) and stepped on another
    thread without it (the engine's), or stepped after the caller left its autocast, crashed inside torch (other
    dtypes in one forward) or was refused naming the static cache. Its steps run under the autocast of its start
    now: the tokens of a session started and stepped under it, for start() and for continuous batching."""
    import threading

    target = FAMILIES["llama"](vocab=VOCAB).to(torch.float16)
    draft = perturbed(target, scale=0.3)
    ids = torch.tensor([[5, 9, 11, 20]])
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, cache_implementation=cache)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        session = sk.SpeculativeDecoder(target, draft, num_speculative_tokens=3).start(ids, **kwargs)
        while not session.finished:
            session.step()
        expected = session.sequences()
        session = sk.SpeculativeDecoder(target, draft, num_speculative_tokens=3).start(ids, **kwargs)
        session.step()
    errors = []

    def engine():  # another thread, without autocast
        try:
            while not session.finished:
                session.step()
        except Exception as error:  # (reported below, in the test's thread)
            errors.append(error)

    worker = threading.Thread(target=engine)
    worker.start()
    worker.join()
    assert not errors and torch.equal(session.sequences(), expected), errors
    if cache == "static":
        return
    decoders = [sk.SpeculativeDecoder(target, draft, num_speculative_tokens=3) for _ in range(2)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        requests = [decoder.add_request([5, 9, 11, 20], max_new_tokens=8, do_sample=False) for decoder in decoders]
        while decoders[0].has_work():
            decoders[0].step()
        decoders[1].step()
    while decoders[1].has_work():  # (outside the autocast)
        decoders[1].step()
    tokens = [decoder.result(request).token_ids for decoder, request in zip(decoders, requests)]
    assert tokens[1] == tokens[0] and len(tokens[0]) == 8


@pytest.mark.parametrize("dtypes", [("bfloat16", "bfloat16"), ("bfloat16", "float32"), ("float16", "bfloat16")],
                         ids=["bfloat16", "bfloat16-target-float32-draft", "float16-target-bfloat16-draft"])
def test_sampled_q_is_the_distribution_the_draft_drew_from(monkeypatch, dtypes):
    """Sampling with a target and a draft in half or mixed precision: the draft logits the verification reads as q
    are, bit for bit and in the same dtype, the logits each draft token was drawn from (with a warper the op lacks,
    min_p, so HF's warpers run on them first and their output is stored in the draft's dtype). A q other than the
    one drawn from (a float32 draft's q cast to a bfloat16 target's dtype after the draw; a bfloat16 draft drawn
    from its float32 warped logits and verified with their bfloat16 copy) verifies another distribution than the
    one sampled: 3e-4 of total variation in one verified position for the float32 draft's q (measured on
    ``helpers/half_sampling_differential.py``'s models), which a chi-square test sees only with about 6 * 10**7
    samples of it; here it is exact."""
    import speculative_kernels.ops.torch_backend as backend

    as_dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
    target = FAMILIES["llama"](vocab=VOCAB).to(as_dtype[dtypes[0]])
    draft = perturbed(FAMILIES["llama"](vocab=VOCAB), scale=0.3).to(as_dtype[dtypes[1]])
    drawn, checked = [], []
    sample, verify = backend.sample, backend.verify

    def recording_sample(logits, sampling, randomness):
        drawn.append(logits.clone())
        return sample(logits, sampling, randomness)

    def checking_verify(target_logits, draft_logits, draft_tokens, sampling, randomness, num_draft_tokens=None):
        if draft_logits is not None:
            assert len(drawn) == draft_logits.shape[1]
            for i, logits in enumerate(drawn):
                assert draft_logits.dtype == logits.dtype and torch.equal(draft_logits[:, i], logits), i
            checked.append(len(drawn))
        drawn.clear()
        return verify(target_logits, draft_logits, draft_tokens, sampling, randomness, num_draft_tokens)

    monkeypatch.setattr(backend, "sample", recording_sample)
    monkeypatch.setattr(backend, "verify", checking_verify)
    ids, mask = left_padded([5, 9, 3], seed=4)
    sk.generate(target, ids, attention_mask=mask, draft_model=draft, num_speculative_tokens=GAMMA,
                max_new_tokens=8, do_sample=True, temperature=0.7, min_p=0.02, pad_token_id=0, seed=0)
    assert checked and all(n == GAMMA for n in checked[:1])
