import os
import sys
import tempfile

# One intra-op thread: the test models are tiny, so their forwards are dominated by per-op overhead, and a second
# OpenMP thread only adds spin-waiting (on a loaded 2-core machine, a tiny forward went from ~5 ms to ~500 ms).
# Subprocesses started by tests inherit it. Set OMP_NUM_THREADS to override.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

sys.path.insert(0, os.path.dirname(__file__))  # the shared helpers: tests/helpers/

if not torch.cuda.is_available():
    # Triton kernels run on the CPU through the interpreter; it must be on before any kernel is defined.
    os.environ.setdefault("TRITON_INTERPRET", "1")

if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    # Inductor's on-disk caches do not key their C++ on the instruction set torch dispatches to: after a run on this
    # machine's AVX-512, a run with ATEN_CPU_CAPABILITY=default (how another CPU's kernels are reproduced) reused C++
    # written for at::vec and failed to compile it, and one with =avx2 computed NaN logits (both pass with an empty
    # cache). One cache per capability. (Not through torch._inductor's own default: importing it imports triton,
    # which must not happen before TRITON_INTERPRET is set.)
    capability = torch.backends.cpu.get_cpu_capability().lower()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(
        tempfile.gettempdir(), f"torchinductor_uid{os.getuid()}_{capability}")


def _share_the_interpreters_language_patch():
    """The Triton interpreter patches triton.language (``inspect.getmembers`` over its modules) around every launch
    and again at every call of a @triton.jit helper inside the kernel, where the launch's patch is in place already.
    A helper whose language modules are patched in the running launch reuses that patch (the interpreter's own
    helper patch sets the same attributes again and is never restored; the launch's scope restores them): about a
    third of an interpreted kernel's CPU time. A helper that needs another module (``triton.language.core`` for
    tl.zeros) is patched as the interpreter does. Interpreter internals: applied only where they have the expected
    form (Triton 3.x), else left alone."""
    import inspect

    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    original = getattr(interpreter, "_patch_lang", None)
    scope_type = getattr(interpreter, "_LangPatchScope", None)
    if original is None or scope_type is None or not hasattr(scope_type, "restore"):
        return
    launch = {"patched": None}  # the language modules patched in the running launch (None between launches)
    modules_of = {}  # a helper's language modules (its module's globals, scanned once: ~4% of a launch otherwise)

    def languages(fn):
        if fn not in modules_of:
            modules_of[fn] = frozenset(id(v) for v in fn.__globals__.values()
                                       if inspect.ismodule(v) and v in (tl, tl.core))
        return set(modules_of[fn])

    def patch_lang(fn):
        langs, patched = languages(fn), launch["patched"]
        if patched is not None:  # a helper called inside a launch
            if langs <= patched:
                return scope_type()  # (its scope is discarded by the interpreter)
            patched |= langs
            return original(fn)
        scope = original(fn)
        launch["patched"] = langs
        restore = scope.restore

        def restore_and_end():
            launch["patched"] = None
            restore()

        scope.restore = restore_and_end
        return scope

    interpreter._patch_lang = patch_lang


def _memoize_the_interpreters_numpy_dtypes():
    """The interpreter maps a Triton dtype to its numpy storage dtype on every operation, building its table of
    dtypes anew each time (~6% of an interpreted kernel's CPU time): the same answers, looked up once per element
    type (a block's is its element type's). Left alone where the function is not there (Triton 3.x has it)."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    original = getattr(interpreter, "_get_np_dtype", None)
    if original is None:
        return
    storage = {}

    def np_dtype(tt_dtype):
        key = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        if isinstance(key, tl.pointer_type):  # (unhashable; every pointer is stored as one type)
            key = tl.pointer_type
        try:
            return storage[key]
        except KeyError:
            storage[key] = original(tt_dtype)
            return storage[key]
        except TypeError:  # an unhashable type: as the interpreter does it
            return original(tt_dtype)

    interpreter._get_np_dtype = np_dtype


if os.environ.get("TRITON_INTERPRET") == "1":
    _share_the_interpreters_language_patch()
    _memoize_the_interpreters_numpy_dtypes()
