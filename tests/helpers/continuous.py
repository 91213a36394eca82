"""Driving a ``SpeculativeDecoder``'s continuous batching in tests."""


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
