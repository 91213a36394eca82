"""Serving load test: Poisson arrivals served by ``SpeculativeDecoder``'s continuous batching (``add_request`` /
``step``) against fixed ``start()`` batches, with HF's continuous batching (``generate_batch``) as an offline
reference where the installed transformers has it.

    python benchmarks/serving_load.py --tiny --requests 24 --rate 4          # tiny random pair, CPU or first GPU
    python benchmarks/serving_load.py --target DIR --draft DIR2 --requests 200 --rate 20 --dtype bfloat16

Every request is greedy with its own prompt and ``max_new_tokens`` (uniform in [min, max]), so every method should
produce the same tokens (greedy identity) and the comparison is of scheduling only; each method's tokens per request
are checked against ``model.generate`` on that request alone (untimed, after the runs; ``identical_to_generate`` per
method, and the exit status is 1 where one differs; ``--no-identity-check`` skips it). Arrival times are drawn once (Poisson
process of ``--rate`` requests/s, seeded) and replayed in wall-clock time for each method:

* ``continuous``: requests join the running batch at the first step after they arrive (``add_request``) and leave
  when done; at most ``--max-batch-size`` run, the rest queue; ``continuous_static``: the same on the static cache
  (``cache_implementation="static"``, ``max_context`` = the longest prompt plus ``--max-new``);
  ``continuous_compiled``: that with ``compile=True`` (captured steps), after an untimed warm-up that compiles every
  batch size (``--max-batch-size`` requests arriving together and finishing one by one);
* ``static``: when the engine is idle, every arrived request (up to ``--max-batch-size``) starts one ``start()``
  batch that runs to its end; later arrivals wait for the next batch;
* ``hf_generate_batch``: ``model.generate_batch`` over all requests at once (no arrivals: an offline throughput
  reference only, no latencies), without a draft model; "unavailable" with the reason when it cannot run here;
* ``hf_continuous`` (not in the default list): HF's continuous-batching manager (``init_continuous_batching``, its
  paged cache and scheduler, no draft model) with the same arrivals and per-request ``max_new_tokens``, streamed,
  after one warm-up request.

Reported per method: throughput (new tokens / makespan), TTFT (first token time - arrival) and three latencies
after the first token, p50/p99, since a step emits several tokens at once and the conventions differ:

* ``itl_ms``: per token: each of a chunk's k tokens counted with latency gap / k (the gap since the request's
  previous emission), the token-level convention SGLang reports for multi-token steps;
* ``itl_chunk_ms``: per emission: the gap itself, once per chunk (vLLM's ``benchmark_serving`` ITL, which times the
  streamed chunks a client receives);
* ``tpot_ms``: per request: (last emission - first emission) / (tokens - 1) (vLLM's TPOT).

For a method that emits one token per step (HF's) the three agree up to the population they are taken over; for ours
``itl_ms`` is the smallest. Times include the device synchronisation of each step's host read. Output: one JSON object
on stdout.
"""

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import speculative_kernels as sk  # noqa: E402


def workload(count: int, rate: float, min_new: int, max_new: int, vocab: int, seed: int = 0):
    """[(arrival_s, prompt ids, max_new_tokens)] sorted by arrival: Poisson arrivals, prompts of 8..32 ids."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, size=count))
    arrivals -= arrivals[0]
    return [(float(t), rng.integers(3, vocab, size=int(rng.integers(8, 33))).tolist(),
             int(rng.integers(min_new, max_new + 1))) for t in arrivals]


class Recorder:
    """Per request: arrival time, emission times and the tokens emitted."""

    def __init__(self, requests):
        self.arrival = {i: t for i, (t, _, _) in enumerate(requests)}
        self.emissions = {i: [] for i in self.arrival}
        self.tokens = {i: [] for i in self.arrival}

    def emit(self, index: int, now: float, tokens: list[int]) -> None:
        if tokens:
            self.emissions[index].append((now, len(tokens)))
            self.tokens[index].extend(int(t) for t in tokens)

    def summary(self, start: float, end: float) -> dict:
        ttft, itl, itl_chunk, tpot, tokens = [], [], [], [], 0
        for index, emissions in self.emissions.items():
            if not emissions:
                continue
            ttft.append(emissions[0][0] - start - self.arrival[index])
            previous = emissions[0][0]
            request_tokens = sum(count for _, count in emissions)
            tokens += request_tokens
            for now, count in emissions[1:]:
                itl.extend([(now - previous) / count] * count)
                itl_chunk.append(now - previous)
                previous = now
            if request_tokens > 1:
                tpot.append((emissions[-1][0] - emissions[0][0]) / (request_tokens - 1))

        def pct(values, q):
            return round(float(np.percentile(values, q)) * 1e3, 3) if values else None

        return {"new_tokens": tokens, "makespan_s": round(end - start, 3),
                "throughput_tok_s": round(tokens / (end - start), 2),
                "ttft_ms_p50": pct(ttft, 50), "ttft_ms_p99": pct(ttft, 99),
                "itl_ms_p50": pct(itl, 50), "itl_ms_p99": pct(itl, 99),
                "itl_chunk_ms_p50": pct(itl_chunk, 50), "itl_chunk_ms_p99": pct(itl_chunk, 99),
                "tpot_ms_p50": pct(tpot, 50), "tpot_ms_p99": pct(tpot, 99)}


def identity(target, requests, tokens: dict, pad: int) -> tuple[dict, dict]:
    """Per method: True where every request's tokens equal ``model.generate``'s on that request alone (greedy, its
    own max_new_tokens; untimed), False where one differs, None where the method gives no tokens per request.

    Also returns, per method, where each differing request first differs: its index, the step, the token
    ``model.generate`` chose and the one the method emitted, and ``model.generate``'s own logits there (the chosen
    token's logit, the emitted token's, their gap, and the gap in units of the logits' dtype's spacing at the chosen
    logit's magnitude): a gap of a few units is a near-tie that rounding by batch shape can flip in half precision
    (docs/half_precision.md); a wide one is a defect."""
    device = target.device
    expected, logits = {}, {}
    with torch.inference_mode():
        for index, (_, prompt, new) in enumerate(requests):
            ids = torch.tensor([prompt], device=device)
            out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                                  pad_token_id=pad, return_dict_in_generate=True, output_logits=True)
            expected[index] = out.sequences[0, ids.shape[1]:].tolist()
            logits[index] = [step[0] for step in out.logits]
    same = {method: None if got is None else all(got[i] == expected[i] for i in expected)
            for method, got in tokens.items()}
    differences = {method: [first_difference(i, expected[i], got[i], logits[i], target.dtype) for i in expected
                            if got[i] != expected[i]]
                   for method, got in tokens.items() if got is not None and not same[method]}
    return same, differences


def first_difference(index: int, expected: list, got: list, logits: list, dtype: torch.dtype) -> dict:
    """Where ``got`` first departs from ``expected`` (request ``index``), with the reference's logits there
    (``logits``: one [V] tensor per generated step, as ``model.generate`` returned them, float32 copies of logits
    computed in ``dtype``, the model's: the spacing is that dtype's)."""
    step = next((j for j, (a, b) in enumerate(zip(expected, got)) if a != b), min(len(expected), len(got)))
    record = {"request": index, "step": step, "expected_len": len(expected), "got_len": len(got)}
    if step < len(expected) and step < len(got):
        row = logits[step]
        chosen, emitted = float(row[expected[step]]), float(row[got[step]])
        spacing = 2.0 ** (math.frexp(abs(chosen))[1] - 1) * torch.finfo(dtype).eps if chosen else 0.0
        record.update(expected_token=expected[step], got_token=got[step], expected_logit=chosen,
                      got_logit=emitted, gap=chosen - emitted,
                      gap_in_spacings=(chosen - emitted) / spacing if spacing else None, dtype=str(dtype))
    return record


def _wait_until(start: float, at: float) -> None:
    delay = start + at - time.perf_counter()
    if delay > 0:
        time.sleep(delay)


def run_continuous(target, draft, requests, gamma: int, max_batch_size: int, static_context: int | None = None,
                   compile: bool = False) -> tuple[dict, dict]:
    """static_context: run on the static cache (``cache_implementation="static"``, ``max_context``), else dynamic;
    compile: capture the batch's steps (``compile=True``; static cache only). Like every ``run_*``: (the summary,
    {request index: its tokens} or None where the method gives none per request)."""
    static = {} if static_context is None else dict(cache_implementation="static", max_context=static_context)
    decoder = sk.SpeculativeDecoder(target, draft, num_speculative_tokens=gamma, max_batch_size=max_batch_size,
                                    compile=compile, **static)
    recorder, ids, nxt = Recorder(requests), {}, 0
    start = time.perf_counter()
    while nxt < len(requests) or decoder.has_work():
        now = time.perf_counter() - start
        while nxt < len(requests) and requests[nxt][0] <= now:
            _, prompt, new = requests[nxt]
            ids[decoder.add_request(prompt, max_new_tokens=new, do_sample=False)] = nxt
            nxt += 1
        if not decoder.has_work():
            _wait_until(start, requests[nxt][0])
            continue
        emitted = decoder.step()
        now = time.perf_counter()
        for request_id, tokens in emitted.items():
            recorder.emit(ids[request_id], now, tokens)
    return recorder.summary(start, time.perf_counter()), recorder.tokens


def run_static(target, draft, requests, gamma: int, max_batch_size: int, pad: int) -> tuple[dict, dict]:
    decoder = sk.SpeculativeDecoder(target, draft, num_speculative_tokens=gamma)
    recorder, nxt = Recorder(requests), 0
    start = time.perf_counter()
    while nxt < len(requests):
        _wait_until(start, requests[nxt][0])
        now = time.perf_counter() - start
        batch = []
        while nxt < len(requests) and requests[nxt][0] <= now and len(batch) < max_batch_size:
            batch.append(nxt)
            nxt += 1
        prompts = [requests[i][1] for i in batch]
        width = max(len(p) for p in prompts)
        ids = torch.full((len(batch), width), pad, dtype=torch.int64)
        mask = torch.zeros_like(ids)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt):] = torch.tensor(prompt)
            mask[row, width - len(prompt):] = 1
        # one setting per batch: each row stops at its own length by EOS-free truncation of the longest
        longest = max(requests[i][2] for i in batch)
        device = target.device
        session = decoder.start(ids.to(device), attention_mask=mask.to(device), max_new_tokens=longest,
                                do_sample=False, pad_token_id=pad)
        done = [0] * len(batch)
        while not session.finished:
            emitted = session.step()
            stamp = time.perf_counter()
            for row, tokens in enumerate(emitted):
                want = requests[batch[row]][2] - done[row]
                count = min(len(tokens), max(want, 0))
                done[row] += count
                recorder.emit(batch[row], stamp, list(tokens[:count]))
    return recorder.summary(start, time.perf_counter()), recorder.tokens


def run_hf_generate_batch(target, requests) -> tuple[dict, None]:
    if not hasattr(target, "generate_batch"):
        return {"unavailable": "the installed transformers has no generate_batch"}, None
    from transformers import GenerationConfig

    try:
        config = GenerationConfig(max_new_tokens=max(r[2] for r in requests), do_sample=False,
                                  eos_token_id=target.generation_config.eos_token_id,
                                  pad_token_id=target.generation_config.pad_token_id or 0)
        start = time.perf_counter()
        outputs = target.generate_batch([r[1] for r in requests], generation_config=config, progress_bar=False)
        seconds = time.perf_counter() - start
    except Exception as error:  # noqa: BLE001 - reported, not hidden: this reference is optional
        return {"unavailable": f"{type(error).__name__}: {error}"[:300]}, None
    tokens = sum(len(out.generated_tokens) for out in outputs.values())
    if tokens == 0:
        return {"unavailable": "generate_batch returned no tokens (its requests failed: see its log)"}, None
    return {"new_tokens": tokens, "makespan_s": round(seconds, 3), "throughput_tok_s": round(tokens / seconds, 2),
            "note": "offline: all requests at t=0, max_new_tokens the largest, no draft model"}, None


def run_hf_continuous(target, requests) -> tuple[dict, dict | None]:
    """HF's own continuous batching (``init_continuous_batching``: its paged cache and scheduler, no draft model)
    driven by the same arrivals: each request added when it arrives, with its own max_new_tokens, streamed."""
    if not hasattr(target, "init_continuous_batching"):
        return {"unavailable": "the installed transformers has no init_continuous_batching"}, None
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=max(r[2] for r in requests), do_sample=False,
                              eos_token_id=target.generation_config.eos_token_id,
                              pad_token_id=target.generation_config.pad_token_id or 0)
    try:
        manager = target.init_continuous_batching(generation_config=config)
        manager.start()
        # its set-up (cache allocation, warm-up) happens at the first request: out of the timed run, as ours
        manager.add_request(requests[0][1], request_id="warm-up", max_new_tokens=4)
        while (output := manager.get_result(timeout=60)) is not None and output.request_id != "warm-up":
            pass
    except Exception as error:  # noqa: BLE001 - reported, not hidden: this reference is optional
        return {"unavailable": f"{type(error).__name__}: {error}"[:300]}, None
    recorder, index, seen, finished, nxt = Recorder(requests), {}, {}, 0, 0
    start = time.perf_counter()
    try:
        while finished < len(requests):
            now = time.perf_counter() - start
            while nxt < len(requests) and requests[nxt][0] <= now:
                _, prompt, new = requests[nxt]
                request_id = manager.add_request(prompt, request_id=f"r{nxt}", max_new_tokens=new, streaming=True)
                index[request_id], seen[request_id] = nxt, 0
                nxt += 1
            wait = 0.01 if nxt >= len(requests) else min(0.01, max(requests[nxt][0] - now, 0.0005))
            output = manager.get_result(timeout=wait)
            if output is None or output.request_id not in index:
                continue
            if output.error:
                return {"unavailable": f"request {output.request_id} failed: {output.error}"[:300]}, None
            new_tokens = list(output.generated_tokens[seen[output.request_id]:])
            seen[output.request_id] = len(output.generated_tokens)
            recorder.emit(index[output.request_id], time.perf_counter(), new_tokens)
            finished += int(output.is_finished())
    finally:
        manager.stop(block=True)
    return ({**recorder.summary(start, time.perf_counter()), "note": "HF's continuous batching, no draft model"},
            recorder.tokens)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny random Llama pair (benchmarks/e2e_batching.py)")
    parser.add_argument("--target")
    parser.add_argument("--draft")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--rate", type=float, default=4.0, help="mean arrivals per second")
    parser.add_argument("--min-new", type=int, default=8)
    parser.add_argument("--max-new", type=int, default=48)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument("--json", type=Path, help="also write the result here")
    parser.add_argument("--no-identity-check", dest="identity_check", action="store_false",
                        help="skip comparing each method's tokens with model.generate on each request alone")
    parser.add_argument("--no-warm-up", dest="warm_up", action="store_false",
                        help="skip the untimed warm-up run of two short requests before each method")
    parser.add_argument("--methods", nargs="+", default=["continuous", "static", "hf_generate_batch"],
                        choices=["continuous", "continuous_static", "continuous_compiled", "static",
                                 "hf_generate_batch", "hf_continuous"])
    args = parser.parse_args(argv)
    if args.tiny == bool(args.target or args.draft):
        parser.error("pass --tiny, or --target and --draft")
    if not 1 <= args.min_new <= args.max_new:
        parser.error(f"--min-new ({args.min_new}) must be >= 1 and <= --max-new ({args.max_new})")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.tiny:
        from e2e_batching import tiny_pair

        target, draft = tiny_pair()
        target.generation_config.eos_token_id = None
    else:
        from transformers import AutoModelForCausalLM

        dtype = getattr(torch, args.dtype)
        target = AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype).eval()
        draft = AutoModelForCausalLM.from_pretrained(args.draft, dtype=dtype).eval()
    target, draft = target.to(device), draft.to(device)
    pad = target.generation_config.pad_token_id
    pad = 0 if pad is None else int(pad)
    requests = workload(args.requests, args.rate, args.min_new, args.max_new, target.config.vocab_size)
    results = {"device": str(device), "requests": args.requests, "rate": args.rate, "gamma": args.gamma,
               "max_batch_size": args.max_batch_size, "methods": {}}
    static_context = max(len(r[1]) for r in requests) + args.max_new
    tokens = {}  # method -> {request index: its tokens}, or None where the method does not give them per request
    for method in args.methods:
        with torch.inference_mode(not method.startswith("hf_")):  # HF's manager updates its tensors in place
            if args.warm_up and method == "continuous_compiled":  # every batch size compiles once, untimed:
                # max_batch_size requests arrive together and finish one by one (B = M, M-1, ..., 1)
                warm_up = [(0.0, requests[i % len(requests)][1], (args.gamma + 2) * (i + 1))
                           for i in range(args.max_batch_size)]
                run_continuous(target, draft, warm_up, args.gamma, args.max_batch_size, static_context, compile=True)
            elif args.warm_up and method in ("continuous", "continuous_static", "static"):  # first-call costs untimed
                warm_up = [(0.0, r[1], 4) for r in requests[:2]]
                if method == "static":
                    run_static(target, draft, warm_up, args.gamma, args.max_batch_size, pad)
                else:
                    run_continuous(target, draft, warm_up, args.gamma, args.max_batch_size,
                                   static_context if method == "continuous_static" else None)
            if method == "continuous":
                outcome = run_continuous(target, draft, requests, args.gamma, args.max_batch_size)
            elif method in ("continuous_static", "continuous_compiled"):
                outcome = run_continuous(target, draft, requests, args.gamma, args.max_batch_size, static_context,
                                         compile=method == "continuous_compiled")
            elif method == "static":
                outcome = run_static(target, draft, requests, args.gamma, args.max_batch_size, pad)
            elif method == "hf_continuous":
                outcome = run_hf_continuous(target, requests)
            else:
                outcome = run_hf_generate_batch(target, requests)
        summary, tokens[method] = outcome
        results["methods"][method] = summary
    if args.identity_check:
        results["identical_to_generate"], results["first_differences"] = identity(target, requests, tokens, pad)
    print(json.dumps(results, indent=2))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    sys.exit(0 if False not in main().get("identical_to_generate", {}).values() else 1)
