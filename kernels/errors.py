"""The kernels' own errors. ``kernels`` sits below ``kvmesh`` and imports nothing of it, so the engine
turns these into its domain errors where it calls in (``kvmesh.engine.model``)."""


class KernelUnavailable(RuntimeError):
    """An op or weight format cannot run here (device, dtype, processor, compiler); the message says why."""


class UnknownScheme(ValueError):
    """A quantization scheme the kernels do not have."""
