"""Two threads on one model, the first held inside one of its forwards while the second runs: what a model shared
by a server's threads meets (HF lets several threads run one model's generate)."""

import threading

import speculative_kernels as sk


def run_while_held(module, run_a, run_b, holds=lambda module: True, catch=()) -> dict:
    """Thread "A" runs ``run_a()``; at the end of ``module``'s first forward in A for which ``holds(module)`` is
    true (a forward hook), A waits until thread "B" has run ``run_b()``. Returns {"a": A's result, "b": B's}, where
    an exception of a type in ``catch`` raised by ``run_b`` is B's result. Fails unless A was held and both ended."""
    a_inside, b_done, out = threading.Event(), threading.Event(), {}

    def hold_a(held, args, output):
        if threading.current_thread().name == "A" and not a_inside.is_set() and holds(held):
            a_inside.set()
            b_done.wait(60)

    def thread_b():
        a_inside.wait(60)
        try:
            out["b"] = run_b()
        except catch as error:
            out["b"] = error
        finally:
            b_done.set()

    holder = module.register_forward_hook(sk.per_token_hook(hold_a))
    try:
        threads = [threading.Thread(target=lambda: out.update(a=run_a()), name="A"),
                   threading.Thread(target=thread_b, name="B")]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
    finally:
        holder.remove()
    assert a_inside.is_set() and set(out) == {"a", "b"}, (a_inside.is_set(), sorted(out))
    return out
