"""Driving a ``SpeculativeDecoder``'s continuous batching in tests."""

import torch

import speculative_kernels as sk


def alone(target, draft, prompt, settings, gamma: int, device):
    """A request decoded alone: ``model.generate`` when greedy, else ``speculative_kernels.generate`` with its seed
    (pad id 0). Returns its new token ids."""
    ids = torch.tensor([prompt], device=device)
    if not settings.get("do_sample"):
        out = target.generate(ids, pad_token_id=0, **settings)
    else:
        out = sk.generate(target, ids, draft_model=draft, num_speculative_tokens=gamma, pad_token_id=0, **settings)
    return out[0, len(prompt):].tolist()


def run_arrivals(decoder, arrivals, each_step=None):
    """arrivals: {step index: [(prompt, settings), ...]} added before that step; each_step(decoder) after every
    step. Steps until no work is left. Returns ({id: (prompt, settings)}, {id: streamed tokens})."""
    requests, streamed, step = {}, {}, 0
    while step <= max(arrivals) or decoder.has_work():
        for prompt, settings in arrivals.get(step, []):
            requests[decoder.add_request(prompt, **settings)] = (prompt, settings)
        for request_id, tokens in decoder.step().items():
            streamed.setdefault(request_id, []).extend(tokens)
        if each_step is not None:
            each_step(decoder)
        step += 1
    return requests, streamed
