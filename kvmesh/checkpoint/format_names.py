"""The quantization formats' names, without torch: `kvmesh quantize --format` offers them, and
every `kvmesh` command (`kvmesh health` in each container's health check, every 10 s) parses
its arguments without importing torch. kvmesh.checkpoint.formats defines the formats under
these names and checks the two agree when it is imported."""

FORMAT_NAMES: tuple[str, ...] = ("fp8-tensor", "fp8-channel", "int8-channel", "nvfp4")
