"""Does cuDNN attention's per-shape planning make the dynamic-cache serving steps slow on the GPU?  ~40-80 s.

    python benchmarks/diagnose_serving_gpu.py --out DIR/diag.json         # on the GPU (bf16, the demo pair)
    python benchmarks/diagnose_serving_gpu.py --requests 12 --no-prof     # CPU dry run (fp32): the code path only

The fourth GPU run (benchmarks/RESULTS.md) found our continuous batching on the dynamic cache 2-6x slower per step
than on the static cache on an H200. The runners now leave SDPA's cuDNN backend out of their eager forwards
(``speculative_kernels/generation/runners/attention_backends.py``); this script measures that choice against the
previous behaviour (cuDNN allowed, torch's default order) on the same steps.

Options: --requests 24 --rate 8 (the serving_load.py workload), --run-cap 20 (seconds per serving run at most),
--budget 80 (later sections are skipped past it), --no-micro, --no-prof. Needs only torch, transformers, numpy and
this package (benchmarks/serving_load.py's ``workload``).

Hypothesis H1 (main): on sm90/sm100 with torch >= 2.11 (+ its bundled cuDNN > 9.15.0) SDPA tries cuDNN attention
first; our runners always pass an explicit additive mask (flash is ineligible, cuDNN takes it as a bias), and cuDNN
builds and caches one execution plan per (q/k/v/bias shape+stride) key (aten/src/ATen/native/cudnn/MHA.cpp,
MHACacheKeyWrapper). The dynamic cache's key length s_kv changes at every forward (draft steps, verify, joins,
rollbacks), so almost every step meets 2-5 never-seen keys and pays a plan build per key; the static cache's s_kv
is its fixed capacity, so only a new batch size / width builds. B=1 benchmarks repeat the same prompts after a
warm-up, so their shapes are all cached (greedy: identical shape sequence) and look normal.

Sections (each prints as it goes; a JSON with everything goes to --out):
  env    versions, cuDNN version, SDPA priority order, the backend SDPA picks for a recorded verify/draft call
  micro  SDPA alone: first-call vs second-call ms of never-seen key lengths, for cuDNN (with and without a bias
         mask) and mem-efficient (H1 predicts: cuDNN+bias first call >> second call; efficient flat)
  runs   the serving path (continuous add_request/step) on the demo pair with a deterministic step clock (every
         config sees the same arrivals -> the same shapes), per-step wall times and first-seen SDPA keys per step:
           dyn_no_cudnn   dynamic cache, the runners as shipped (cuDNN left out)       (H1: fast, like static)
           dyn_default    dynamic cache, cuDNN allowed (torch's default order), cold    (H1: slow)
           dyn_repeat     the same run again: every shape now cached                    (H1: fast again)
           static_default static cache (fixed s_kv), cuDNN allowed                      (H1: fast, spikes at new B)
         H1 confirmed if dyn_default's steps with new keys are >> its steps without, and dyn_no_cudnn /
         dyn_repeat are close to static_default. Refuted if dyn_no_cudnn is as slow as dyn_default.
  prof   torch.profiler over 8 steps of a fresh dynamic run (new prompts -> new shapes): top ops by self CPU and
         by device time (H1: aten::_scaled_dot_product_cudnn_attention / cudnn build dominating self CPU).
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

T0 = time.perf_counter()


def elapsed() -> float:
    return time.perf_counter() - T0


def log(*args):
    print(f"[{elapsed():6.1f}s]", *args, flush=True)


# ------------------------------------------------------------------------------------------------ SDPA key recorder
ORIG_SDPA = F.scaled_dot_product_attention


class Keys:
    """Records each SDPA call's cuDNN graph-cache key (MHA.cpp's MHAParams: dtype, q/k/v dims and strides, bias dims
    and strides, causal) and whether this process saw it before."""

    def __init__(self):
        self.seen, self.calls, self.new, self.sample = set(), 0, 0, {}
        self.run_seen = set()  # keys of the current run: "new" is counted against this while cuDNN is off
        self.cudnn_on = True  # calls made with cuDNN SDPA disabled build no plan: they do not fill ``seen``

    def __call__(self, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kw):
        m = None if attn_mask is None else (tuple(attn_mask.shape), tuple(attn_mask.stride()), attn_mask.dtype)
        key = (q.dtype, tuple(q.shape), tuple(q.stride()), tuple(k.shape), tuple(k.stride()), tuple(v.stride()),
               m, bool(is_causal), bool(kw.get("enable_gqa", False)))
        self.calls += 1
        seen = self.seen if self.cudnn_on else self.run_seen
        if key not in seen:
            seen.add(key)
            self.new += 1
        kind = "verify" if q.shape[2] > 2 and q.shape[2] != k.shape[2] else "draft" if q.shape[2] <= 2 else "prefill"
        if kind not in self.sample:
            self.sample[kind] = (q, k, v, attn_mask, is_causal)
        return ORIG_SDPA(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kw)

    def take(self) -> tuple[int, int]:
        out = (self.calls, self.new)
        self.calls = self.new = 0
        return out


KEYS = Keys()
NO_CUDNN_STEPS: list = []
F.scaled_dot_product_attention = KEYS  # (transformers' sdpa_attention_forward looks it up at call time)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


# ------------------------------------------------------------------------------------------------ sections
def env_section(device) -> dict:
    info = {"torch": torch.__version__, "device": str(device)}
    try:
        import transformers
        info["transformers"] = transformers.__version__
    except Exception as e:  # noqa: BLE001
        info["transformers"] = repr(e)
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        info.update(gpu=p.name, capability=f"{p.major}.{p.minor}", cudnn=torch.backends.cudnn.version(),
                    cudnn_sdp_enabled=torch.backends.cuda.cudnn_sdp_enabled(),
                    flash_sdp_enabled=torch.backends.cuda.flash_sdp_enabled(),
                    mem_efficient_sdp_enabled=torch.backends.cuda.mem_efficient_sdp_enabled(),
                    TORCH_CUDNN_SDPA_DEPRIORITIZED=os.environ.get("TORCH_CUDNN_SDPA_DEPRIORITIZED"))
        try:  # the default order is set at the first SDPA call: make one
            x = torch.randn(1, 2, 8, 64, device=device, dtype=torch.bfloat16)
            ORIG_SDPA(x, x, x)
            info["sdp_priority_order"] = [str(torch.nn.attention.SDPBackend(i)) for i in
                                          torch._C._get_sdp_priority_order()]
        except Exception as e:  # noqa: BLE001
            info["sdp_priority_order"] = repr(e)
    try:
        from speculative_kernels.ops import backends
        info["sk_ops_backend"] = backends.resolve("auto", device.type)
    except Exception as e:  # noqa: BLE001
        info["sk_ops_backend"] = repr(e)
    log("env", json.dumps(info))
    return info


def backend_choice(sample) -> str:
    q, k, v, mask, causal = sample
    try:
        choice = torch._fused_sdp_choice(q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=causal)
        return str(torch.nn.attention.SDPBackend(choice))
    except Exception as e:  # noqa: BLE001
        return repr(e)


def micro_section(device, dtype) -> dict:
    """First call (plan build) vs second call of never-seen key lengths, per backend."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    out = {}
    B, H, D = 8, 2, 64
    cases = {"cudnn+bias": ([SDPBackend.CUDNN_ATTENTION], True), "cudnn,no-mask": ([SDPBackend.CUDNN_ATTENTION], False),
             "efficient+bias": ([SDPBackend.EFFICIENT_ATTENTION], True), "default+bias": (None, True)}
    base = 300
    for name, (backends, with_mask) in cases.items():
        if device.type != "cuda" and backends is not None:
            continue
        firsts, seconds, began = [], [], time.perf_counter()
        for i in range(4):
            base += 7  # a key length no other case used: a never-seen cuDNN key
            for T in (1, 5):
                q = torch.randn(B, H, T, D, device=device, dtype=dtype)
                k = torch.randn(B, H, base, D, device=device, dtype=dtype)
                mask = torch.zeros(B, 1, T, base, device=device, dtype=dtype) if with_mask else None
                times = []
                for _ in range(2):
                    sync(device)
                    t = time.perf_counter()
                    try:
                        if backends is None:
                            ORIG_SDPA(q, k, k, attn_mask=mask)
                        else:
                            with sdpa_kernel(backends):
                                ORIG_SDPA(q, k, k, attn_mask=mask)
                    except Exception as e:  # noqa: BLE001
                        out[name] = f"error: {type(e).__name__}: {str(e)[:200]}"
                        break
                    sync(device)
                    times.append((time.perf_counter() - t) * 1e3)
                if len(times) == 2:
                    firsts.append(times[0]); seconds.append(times[1])
            if isinstance(out.get(name), str) or time.perf_counter() - began > 5:
                break
        if firsts:
            out[name] = {"first_call_ms_median": round(statistics.median(firsts), 3),
                         "first_call_ms_max": round(max(firsts), 3),
                         "second_call_ms_median": round(statistics.median(seconds), 3)}
        log("micro", name, out.get(name))
    return out


def load_pair(repo: Path, device, dtype):
    from transformers import AutoModelForCausalLM

    d = repo / "speculative_kernels" / "demo_models"
    target = AutoModelForCausalLM.from_pretrained(d / "target", dtype=dtype).eval().to(device)
    draft = AutoModelForCausalLM.from_pretrained(d / "draft", dtype=dtype).eval().to(device)
    return target, draft


def serve(sk, target, draft, requests, static_context=None, step_s=0.03, profile_steps=None, max_s=None,
          max_steps=None):
    """Continuous batching with a simulated clock (each step advances it by step_s): the same admissions and shapes
    in every config. Stops after max_s seconds or max_steps steps (the first n steps are the same in every config).
    Returns per-step (ms, SDPA calls, first-seen keys, batch) and {request index: tokens}."""
    kw = {} if static_context is None else dict(cache_implementation="static", max_context=static_context)
    dec = sk.SpeculativeDecoder(target, draft, num_speculative_tokens=4, max_batch_size=16, **kw)
    steps, tokens, nxt, clock, ids, began = [], {}, 0, 0.0, {}, time.perf_counter()
    prof = None
    KEYS.take()
    while nxt < len(requests) or dec.has_work():
        while nxt < len(requests) and requests[nxt][0] <= clock:
            _, p, n = requests[nxt]
            ids[dec.add_request(p, max_new_tokens=n, do_sample=False)] = nxt
            nxt += 1
        if not dec.has_work():
            clock = requests[nxt][0]
            continue
        if (max_s is not None and time.perf_counter() - began > max_s) or (max_steps is not None
                                                                          and len(steps) >= max_steps):
            break
        if profile_steps is not None and len(steps) == profile_steps[0]:
            prof = profile_steps[2]
            prof.__enter__()
        t = time.perf_counter()
        emitted = dec.step()  # (ends with the step's host read: the device is idle after it)
        ms = (time.perf_counter() - t) * 1e3
        if prof is not None and len(steps) + 1 == profile_steps[1]:
            prof.__exit__(None, None, None)
            prof = None
        calls, new = KEYS.take()
        for request_id, emitted_ids in emitted.items():
            tokens.setdefault(ids[request_id], []).extend(emitted_ids)
        steps.append((ms, calls, new, len(dec._batcher._rows)))
        clock += step_s
    if prof is not None:
        prof.__exit__(None, None, None)
    return steps, tokens


def summarize(name, steps, tokens, common=None) -> dict:
    """common: also the seconds of the first ``common`` steps (the step range every config ran)."""
    ms = [s[0] for s in steps]
    tokens = sum(len(t) for t in tokens.values())
    with_new = [s[0] for s in steps if s[2]]
    without = [s[0] for s in steps if not s[2]]
    r = {"steps": len(steps), "total_s": round(sum(ms) / 1e3, 3), "tokens": tokens,
         "tok_per_s": round(tokens / (sum(ms) / 1e3), 1),
         "step_ms_p50": round(float(np.percentile(ms, 50)), 2), "step_ms_p90": round(float(np.percentile(ms, 90)), 2),
         "step_ms_max": round(max(ms), 2),
         "first_n_steps": common, "first_n_mean_ms": round(statistics.mean(ms[:common]), 2) if common else None,
         "first_seen_keys": sum(s[2] for s in steps),
         "steps_with_new_keys": len(with_new),
         "ms_p50_steps_with_new_keys": round(statistics.median(with_new), 2) if with_new else None,
         "ms_p50_steps_without": round(statistics.median(without), 2) if without else None,
         "slowest": [dict(ms=round(s[0], 1), sdpa_calls=s[1], new_keys=s[2], batch=s[3])
                     for s in sorted(steps, reverse=True)[:5]]}
    log("run", name, json.dumps({k: v for k, v in r.items() if k != "slowest"}))
    log("    slowest steps", r["slowest"])
    return r


def allow_cudnn_in_runners(allow: bool) -> None:
    """allow: the runners' forwards run under torch's default SDPA order (cuDNN first on sm90 with torch 2.11), as
    before ``attention_backends.without_cudnn_attention``; otherwise the switch as shipped."""
    import contextlib

    from speculative_kernels.generation.runners import attention_backends, decoder, seq2seq, static_decoder

    switch = (lambda device: contextlib.nullcontext()) if allow else attention_backends.without_cudnn_attention
    for module in (decoder, static_decoder, seq2seq):
        module.without_cudnn_attention = switch


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repo", default=".")
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--rate", type=float, default=8.0)
    ap.add_argument("--budget", type=float, default=80.0, help="seconds: later sections are skipped past it")
    ap.add_argument("--run-cap", type=float, default=20.0, help="seconds per serving run at most")
    ap.add_argument("--no-micro", action="store_true")
    ap.add_argument("--no-prof", action="store_true")
    ap.add_argument("--out")
    a = ap.parse_args()
    repo = Path(a.repo).resolve()
    sys.path.insert(0, str(repo)); sys.path.insert(0, str(repo / "benchmarks"))
    import speculative_kernels as sk
    from serving_load import workload

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    result = {"env": env_section(device)}
    if not a.no_micro:
        result["micro"] = micro_section(device, dtype)
    target, draft = load_pair(repo, device, dtype)
    requests = workload(a.requests, a.rate, 8, 48, target.config.vocab_size)
    context = max(len(r[1]) for r in requests) + 48
    result["runs"] = {}
    # warm-up: one request per path (kernels, allocator, CUDA ext/Triton loading), on prompts of other lengths
    warm = [(0.0, [5] * 7, 6)]
    with torch.inference_mode():
        serve(sk, target, draft, warm)
        serve(sk, target, draft, warm, static_context=context)
    # dyn_default may be very slow (a plan build per new key): it is capped at --run-cap seconds; the configs after
    # it run its step count, so all four compare over the same first n steps (same arrivals, same shapes)
    configs = [("dyn_no_cudnn", None, False), ("dyn_default", None, True), ("dyn_repeat", None, True),
               ("static_default", context, True)]
    common, outputs = None, {}
    for name, static, cudnn in configs:
        if elapsed() > a.budget:
            log("skip", name, "(budget)"); continue
        allow_cudnn_in_runners(cudnn)
        KEYS.cudnn_on, KEYS.run_seen = cudnn, set()
        with torch.inference_mode():
            steps, tokens = serve(sk, target, draft, requests, static_context=static, max_s=a.run_cap,
                                  max_steps=None if name in ("dyn_no_cudnn", "dyn_default") else common)
        if name == "dyn_default":
            common = len(steps)
        outputs[name] = tokens
        if name == "dyn_no_cudnn":
            NO_CUDNN_STEPS[:] = steps
        result["runs"][name] = summarize(name, steps, tokens, common)
    base = outputs.get("dyn_no_cudnn", {})
    result["same_tokens_as_dyn_no_cudnn"] = {  # greedy: requests finished in both runs must agree token for token
        n: all(base.get(i) == t[:len(base.get(i, []))] or base.get(i, [])[:len(t)] == t for i, t in o.items())
        for n, o in outputs.items() if n != "dyn_no_cudnn"}
    log("same tokens (prefixes) as dyn_no_cudnn:", result["same_tokens_as_dyn_no_cudnn"])
    allow_cudnn_in_runners(True)  # (the backend torch's default order picks, for the record below)
    KEYS.cudnn_on = True
    result["sdpa_backend_picked"] = {k: backend_choice(v) for k, v in KEYS.sample.items()}
    log("SDPA backend for recorded calls (default flags):", result["sdpa_backend_picked"])
    if not a.no_prof and elapsed() < a.budget:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        prof = profile(activities=acts, record_shapes=False)
        fresh = workload(max(8, a.requests // 2), a.rate, 8, 48, target.config.vocab_size, seed=1)
        with torch.inference_mode():
            steps, tokens = serve(sk, target, draft, fresh, profile_steps=(6, 14, prof), max_steps=14,
                                  max_s=min(a.run_cap, 15.0))
        result["runs"]["prof_fresh_dynamic"] = summarize("prof_fresh_dynamic (profiled steps 6-13)", steps, tokens)
        sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
        table_cpu = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=60)
        print(table_cpu, flush=True)
        result["prof_self_cpu"] = table_cpu
        if sort != "self_cpu_time_total":
            table_dev = prof.key_averages().table(sort_by=sort, row_limit=10, max_name_column_width=60)
            print(table_dev, flush=True)
            result["prof_self_device"] = table_dev
    runs = result["runs"]
    # mean step ms over the first `common` steps (the steps dyn_default ran; a capped run: over the steps it ran)
    firsts = {k: v["first_n_mean_ms"] for k, v in runs.items()
              if v.get("first_n_mean_ms") is not None and not k.startswith("prof")}
    if "dyn_no_cudnn" in runs and common:
        firsts["dyn_no_cudnn"] = round(statistics.mean(s[0] for s in NO_CUDNN_STEPS[:common]), 2)
        runs["dyn_no_cudnn"]["first_n_steps"], runs["dyn_no_cudnn"]["first_n_mean_ms"] = common, firsts["dyn_no_cudnn"]
    result["first_n_mean_step_ms"] = firsts
    log(f"mean step ms over the same first {common} steps:", firsts)
    if device.type != "cuda":
        result["verdict"] = "n/a on CPU (no cuDNN): a dry run of the code path only"
    elif {"dyn_default", "dyn_no_cudnn", "dyn_repeat"} <= set(firsts):
        d, n, r = firsts["dyn_default"], firsts["dyn_no_cudnn"], firsts["dyn_repeat"]
        if d > 1.8 * max(n, r):
            result["verdict"] = ("H1 CONFIRMED: the cold dynamic run is slow; the same steps with cuDNN SDPA off, or "
                                 "with every shape already in cuDNN's plan cache, are fast")
        elif d > 1.8 * n:
            result["verdict"] = "H1 PARTLY: cuDNN off helps but a warm plan cache does not (per-call cuDNN cost?)"
        else:
            result["verdict"] = "H1 REFUTED: cuDNN off is as slow: look at the profiler tables (H2-H5)"
    log("VERDICT:", result.get("verdict"))
    log("done")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
