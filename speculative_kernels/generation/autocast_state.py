"""The caller's autocast state, captured where a session's caches are first filled and entered again at its later
steps: autocast is per thread, and a session may be stepped from another thread than the one that started it (a
server's request handler under autocast, its engine thread without), or between steps under another state; its
forwards must keep the numerics its caches were filled with (other dtypes in one forward crash inside torch)."""

import contextlib
import dataclasses

import torch

DEVICE_TYPES = ("cpu", "cuda")


@dataclasses.dataclass(frozen=True)
class AutocastState:
    """(device type, enabled, dtype) of torch's autocast for each device type of ``DEVICE_TYPES``."""

    settings: tuple[tuple[str, bool, torch.dtype], ...]

    @classmethod
    def current(cls) -> "AutocastState":
        """This thread's state now."""
        return cls(tuple((device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
                         for device in DEVICE_TYPES))

    @contextlib.contextmanager
    def entered(self):
        """This state, for the block, on the device types where this thread's differs (none: nothing entered)."""
        now = dict((device, (enabled, dtype)) for device, enabled, dtype in AutocastState.current().settings)
        with contextlib.ExitStack() as stack:
            for device, enabled, dtype in self.settings:
                if now[device] != (enabled, dtype):
                    stack.enter_context(torch.autocast(device, dtype=dtype, enabled=enabled))
            yield
