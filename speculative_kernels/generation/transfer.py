"""Host values to the device without a host synchronisation.

``torch.tensor(values, device="cuda")`` copies from pageable host memory, which CUDA does synchronously: the host
waits for every kernel already queued on the stream before it can go on. In the decode loop that is a stall per
call (a second synchronisation per iteration beside the one read of the results). Going through pinned memory
makes the copy asynchronous; torch's pinned-memory allocator keeps the staging buffer alive until the copy has run.
"""

import torch

__all__ = ["host_to_device"]


def host_to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` (a Python list, or nested lists) as a tensor of ``dtype`` on ``device``; on CUDA an asynchronous
    copy from pinned memory, elsewhere ``torch.tensor``."""
    device = torch.device(device)
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, device="cpu", pin_memory=True).to(device, non_blocking=True)
