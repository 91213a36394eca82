"""The SSM step-size bound of transformers' Mamba2 mixers: where it applies in ``model.generate``, and how the
speculative forwards apply it in the same places.

transformers' Mamba2 mixers (Mamba2, Bamba, Granite 4 hybrids, Falcon-H1, Zamba2, Nemotron-H; 5.17 to 5.24) clamp
dt = softplus(dt + dt_bias) to ``time_step_limit`` in their chunked scan, the path of a forward over several tokens,
and not in their one-token step (``mamba2_selective_state_update`` takes no limit, nor does mamba_ssm's kernel).
model.generate runs the whole prompt through the scan (clamped) and every later token through the step (unclamped).
So a model whose limit is bounded (Zamba2's and Nemotron-H's: (time_step_min, inf), 0.001 by default) is exact when

* the target's prompt forwards are model.generate's own (the whole prompt, clamped; the first token is drawn from
  them: ``SpeculativeLoop``'s ``first_token_from_prompt``, as the last prompt token is clamped there), and
* every forward after the prompt (verifications, re-runs of kept tokens) runs its scan with the limit lifted to
  (0, inf) (``unbounded_step_size``), which then continues the state as the steps do: measured on tiny Zamba2 and
  Nemotron-H models whose dt falls under the limit (up to half the heads), 3.8e-6 of the logits' scale against
  model.generate's steps, 2.2e-2 with the limit kept, 1.2e-2 with the last prompt token in a lifted scan
  (transformers 5.17 and 5.24, torch path).

Every mixer reads ``self.time_step_limit`` when it runs (it passes ``dt_limit=self.time_step_limit`` to the scan,
in every transformers from 5.17 to 5.24; ``unread_limit_classes`` finds a mixer that does not), so the limit is
lifted where that read is answered. The attribute is the model's own, and HF lets other threads run the same model
meanwhile (their model.generate, another call's prompt forward: both must stay clamped), so the lift is the lifting
thread's alone: for the forward, each mixer's class is a subclass of its own (cached, same name) whose
``time_step_limit`` property answers (0, inf) to the threads that lift that mixer now and the mixer's own value
(kept in its ``__dict__``, where a write goes too) to every other; the last lift to end puts the class back,
whatever the forward raised. A model is unchanged afterwards (class, attributes, state_dict).
"""

import contextlib
import copyreg
import functools
import inspect
import threading

import torch

UNBOUNDED = (0.0, float("inf"))
# How the mixers pass the limit to their scan, read at every forward (transformers 5.17-5.24)
_READS_LIMIT = "dt_limit=self.time_step_limit"


def _bounds(module) -> tuple[float, float] | None:
    limit = getattr(module, "time_step_limit", None)
    if not isinstance(limit, (tuple, list)) or len(limit) != 2:
        return None
    low, high = (float(bound) for bound in limit)
    return (low, high) if low > 0.0 or high != float("inf") else None


def bounded_mixers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of ``model`` whose ``time_step_limit`` is a pair that clamps something: a lower bound above 0 or
    a finite upper one (softplus gives dt > 0, so (0, inf) clamps nothing), in ``model.modules()`` order."""
    return [module for module in model.modules() if _bounds(module) is not None]


def bounds_shown(mixers: list[torch.nn.Module]) -> str:
    """The distinct limits of ``mixers``, as '(0.001, inf), ...' for messages."""
    return ", ".join(f"({low:g}, {high:g})" for low, high in sorted({_bounds(module) for module in mixers}))


def unread_limit_classes(mixers: list[torch.nn.Module]) -> list[str]:
    """The classes among ``mixers`` whose forward's class (the first in the MRO defining ``forward``) does not pass
    ``dt_limit=self.time_step_limit`` to its scan, or whose instance does not hold its limit as an attribute of its
    own (a class attribute or property, which the lift's property would hide): ``unbounded_step_size`` could not
    lift such a mixer's limit (none in transformers 5.17-5.24)."""
    return sorted({type(module).__name__ for module in mixers
                   if not _reads_limit(type(module)) or not _holds_own_limit(module)})


def _holds_own_limit(module: torch.nn.Module) -> bool:
    """Whether ``module``'s time_step_limit is an attribute of the instance that no class of its own (ours, the
    lift's, aside) defines too."""
    return "time_step_limit" in vars(module) and not _class_defines_limit(type(module))


@functools.lru_cache(maxsize=None)  # (once per class: checked at every lift)
def _class_defines_limit(klass: type) -> bool:
    return any("time_step_limit" in vars(base) for base in klass.__mro__ if base not in _LIFTING_CLASSES)


@functools.lru_cache(maxsize=None)  # (once per class: every layer's mixer is one, and each call checks the model)
def _reads_limit(klass: type) -> bool:
    owner = next((base for base in klass.__mro__ if "forward" in vars(base)), klass)
    try:
        source = inspect.getsource(owner)
    except (OSError, TypeError):  # (a class defined where its source cannot be read)
        source = ""
    return _READS_LIMIT in source


# The lifts in progress: id(mixer) -> [count over all threads, the mixer's own class]; changed under _LOCK, which
# makes each class swap and its count one step. _HERE.lifted: id(mixer) -> count of the calling thread's lifts.
_LOCK = threading.Lock()
_LIFTS: dict[int, list] = {}
_HERE = threading.local()
_LIFTING: dict[type, type] = {}  # a mixer's own class -> its lifting subclass, made once, under _LOCK
_LIFTING_CLASSES: set[type] = set()  # (the values of _LIFTING)


def _lifting_class(klass: type) -> type:
    """``klass`` with ``time_step_limit`` a property: (0, inf) in a thread that lifts the instance now, else the
    instance's own value (its ``__dict__``'s, which a write sets). Same name and module, so that messages, reprs and
    output recorders see the mixer's own class; pickled or copied meanwhile, a mixer is of its own class. Called
    under _LOCK: one subclass per class, made once (the swap back recognises it; a swap makes no new class)."""
    if klass in _LIFTING:
        return _LIFTING[klass]

    def read(mixer):
        if id(mixer) in getattr(_HERE, "lifted", ()):
            return UNBOUNDED
        return mixer.__dict__["time_step_limit"]

    def write(mixer, value):
        mixer.__dict__["time_step_limit"] = value

    def remove(mixer):
        del mixer.__dict__["time_step_limit"]

    def reduce_ex(mixer, protocol):  # (a deepcopy or pickle during a lift: the mixer's own class)
        reduced = klass.__reduce_ex__(mixer, protocol)
        if isinstance(reduced, tuple) and len(reduced) > 1 and reduced[1] and reduced[1][0] is lifting:
            # (pickle refuses a __newobj__ of a class other than the object's: the standard library's reconstructor)
            reduced = (copyreg._reconstructor, (klass, object, None), *reduced[2:])
        return reduced

    lifting = type(klass.__name__, (klass,), {"time_step_limit": property(read, write, remove),
                                              "__reduce_ex__": reduce_ex, "__module__": klass.__module__,
                                              "__qualname__": klass.__qualname__})
    _LIFTING_CLASSES.add(lifting)
    _LIFTING[klass] = lifting
    return lifting


def _lift(mixers: list[torch.nn.Module]) -> None:
    """Lift ``mixers`` for the calling thread (its counts, then the shared ones; a mixer's first lift swaps its
    class). All or none: a mixer that cannot be lifted raises before any is."""
    if not hasattr(_HERE, "lifted"):  # (the thread's first lift)
        _HERE.lifted = {}
    here = _HERE.lifted
    with _LOCK:
        for mixer in mixers:  # (checked, and their subclasses made, first: nothing raises once the counts change)
            if id(mixer) not in _LIFTS:
                if not _holds_own_limit(mixer):  # (a draft's: a target's is refused before, unread_limit_classes)
                    raise TypeError(f"{type(mixer).__name__}'s time_step_limit is not an attribute of the instance "
                                    "alone: its step-size bound cannot be lifted for one thread")
                _lifting_class(type(mixer))
        for mixer in mixers:
            lifts = _LIFTS.get(id(mixer))
            if lifts is None:
                lifts = _LIFTS[id(mixer)] = [0, type(mixer)]
                object.__setattr__(mixer, "__class__", _lifting_class(type(mixer)))  # (nn.Module's checks: none)
            lifts[0] += 1
            here[id(mixer)] = here.get(id(mixer), 0) + 1


def _unlift(mixers: list[torch.nn.Module]) -> None:
    here = _HERE.lifted
    with _LOCK:
        for mixer in mixers:
            here[id(mixer)] -= 1
            if not here[id(mixer)]:
                del here[id(mixer)]
            lifts = _LIFTS[id(mixer)]
            lifts[0] -= 1
            if not lifts[0]:
                del _LIFTS[id(mixer)]
                if type(mixer) is _LIFTING[lifts[1]]:  # (a class set meanwhile by someone else is theirs: kept)
                    object.__setattr__(mixer, "__class__", lifts[1])


@contextlib.contextmanager
def unbounded_step_size(mixers: list[torch.nn.Module]):
    """Within the block, every module of ``mixers`` reads time_step_limit (0, inf) in the calling thread and its
    own value in every other; afterwards, whatever the block raised, each is as before (its class, its attribute)."""
    _lift(mixers)
    try:
        yield
    finally:
        _unlift(mixers)
