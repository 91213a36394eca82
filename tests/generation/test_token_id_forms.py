"""Token ids given in forms model.generate fails on inside transformers (mutation round 4: mutants S13, I2 passed
every other test)."""

import pytest
import torch

import speculative_kernels as sk
from helpers.models import llama


@pytest.mark.parametrize("pad", [(50,), (0,)])
def test_pad_token_id_as_a_tuple_is_named(pad):
    """pad_token_id given as a tuple fails inside transformers in model.generate (as a list does: "'<' not supported
    between instances of 'tuple' and 'int'"); ours names it. Refusing lists alone let a one-element tuple through."""
    target = llama()
    ids = torch.tensor([[5, 6, 7], [0, 8, 9]])
    with pytest.raises(TypeError, match=r"pad_token_id must be one token id \(an int\)"):
        sk.generate(target, ids, draft_model=target, max_new_tokens=3, do_sample=False, pad_token_id=pad)


@pytest.mark.parametrize("bos", [(9,), [9]])
def test_an_encoder_decoders_bos_list_is_named(bos):
    """An encoder-decoder started from BOS (no input_ids, no encoder_outputs) with bos_token_id given as a list or
    tuple: model.generate fails inside transformers; ours names it, as for a decoder-only prompt (seq2seq_inputs
    calling int() on it gave a TypeError that did not name bos_token_id)."""
    from helpers.seq2seq_models import t5

    model = t5()
    with pytest.raises(TypeError, match=r"bos_token_id must be one token id \(an int\) to start a prompt from"):
        sk.generate(model, None, draft_model=model, max_new_tokens=3, do_sample=False, bos_token_id=bos)
