"""KernelLayer: a layer whose implementation is chosen once, at load (vLLM's CustomOp idea).

Every layer has forward_native, the torch oracle. select(ops) binds `forward` (and any other
method a layer dispatches) to one implementation for good: forward_cpu where the CPU C++ kernels
loaded and cover the layer, forward_native otherwise. A CUDA kernel would be a forward_cuda and
one more case in choose(). Until select() runs, a layer runs its oracle.
"""

from __future__ import annotations

from torch import nn

NATIVE, CPU = "native", "cpu"


class KernelLayer(nn.Module):
    impl: str = NATIVE  # which implementation select() bound
    ops = None  # the CPU kernels (pagedserve_kernels.cpu_ops) once impl is CPU

    def forward(self, *args, **kwargs):
        return self.forward_native(*args, **kwargs)

    def forward_native(self, *args, **kwargs):
        raise NotImplementedError

    def forward_cpu(self, *args, **kwargs):
        raise NotImplementedError

    def choose(self, ops) -> str:
        """The implementation for this layer as loaded (device, dtype, shapes): CPU where the
        kernels loaded and the parameters live on the CPU; layers with narrower kernels say so."""
        return CPU if ops is not None and self.device_type() == "cpu" else NATIVE

    def device_type(self) -> str:
        for tensor in self.parameters():
            return tensor.device.type
        for tensor in self.buffers():
            return tensor.device.type
        return "cpu"

    def select(self, ops) -> None:
        self.impl = self.choose(ops)
        self.ops = ops if self.impl == CPU else None
        self.bind(self.impl)

    def bind(self, impl: str) -> None:
        """Point the instance's forward at the chosen implementation (no per-call branch)."""
        self.forward = self.forward_cpu if impl == CPU else self.forward_native


def select_impls(model: nn.Module, ops) -> dict[str, int]:
    """Chooses every KernelLayer's implementation in model, once; returns impl -> count.

    ops: pagedserve_kernels.cpu_ops.load_cpu_ops() on a CPU device, or None for the torch oracles.
    """
    counts: dict[str, int] = {}
    for module in list(model.modules()):  # selecting adds modules (packed weights)
        if isinstance(module, KernelLayer):
            module.select(ops)
            counts[module.impl] = counts.get(module.impl, 0) + 1
    return counts
