"""The service framework every kvmesh service is built on.

A service's ``main.py`` defines ``build(ctx) -> ServiceDef`` and calls
``run(...)``; tests start the same ``build`` in-process with ``serve(...)``.
Outgoing calls to other services go through ``create_channel`` so the request
id follows the request. See docs/contracts.md for an example.
"""

from kvmesh.runtime.channel import create_channel
from kvmesh.runtime.entrypoint import run
from kvmesh.runtime.flags import Flag, common_flags, parse_flags
from kvmesh.runtime.gpu import GpuStats, gpu_stats
from kvmesh.runtime.logs import configure_logging
from kvmesh.runtime.request_id import METADATA_KEY, current_request_id, new_request_id, request_id_scope
from kvmesh.runtime.server import GrpcService, Runtime, ServiceContext, ServiceDef, serve

__all__ = [
    "METADATA_KEY",
    "Flag",
    "GpuStats",
    "GrpcService",
    "Runtime",
    "ServiceContext",
    "ServiceDef",
    "common_flags",
    "configure_logging",
    "create_channel",
    "current_request_id",
    "gpu_stats",
    "new_request_id",
    "parse_flags",
    "request_id_scope",
    "run",
    "serve",
]
