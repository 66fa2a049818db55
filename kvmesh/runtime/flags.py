"""Command-line flags with ``KVMESH_*`` environment twins.

Every flag can come from the command line or from its environment variable
(compose files and the one-command launcher configure services by env); the
command line wins, then the environment, then the default. A required value
that is set nowhere stops the process at once with exit code 2 and a message
naming both spellings, instead of failing later at first use.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


@dataclass(frozen=True)
class Flag:
    """One flag. ``type=bool`` gives ``--x/--no-x`` and accepts 1/0, true/false, yes/no, on/off from env."""

    name: str  # "--router-address"
    help: str
    default: Any = None
    type: Callable[[str], Any] = str
    required: bool = False
    choices: Sequence[Any] | None = None
    env: str | None = None  # default: KVMESH_ + the name in upper snake case

    @property
    def dest(self) -> str:
        return self.name.lstrip("-").replace("-", "_")

    @property
    def env_var(self) -> str:
        return self.env or "KVMESH_" + self.dest.upper()


# Mutual TLS (kvmesh.runtime.tls): all three, or none for plaintext.
TLS_FLAGS = (
    Flag("--tls-ca", "PEM of the mesh's CA: peers must present a certificate it signed (unset: plaintext)"),
    Flag("--tls-cert", "PEM certificate naming this service's role (spiffe://kvmesh/<role>)"),
    Flag("--tls-key", "PEM private key of --tls-cert"),
)


# OpenTelemetry traces (kvmesh.tracing): off unless an OTLP endpoint is set here or in OTEL_*.
TRACING_FLAGS = (
    Flag(
        "--otlp-endpoint",
        "OTLP/gRPC collector for traces, e.g. http://jaeger:4317 (unset: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, "
        "then OTEL_EXPORTER_OTLP_ENDPOINT; none: tracing off)",
    ),
    Flag(
        "--trace-sample-ratio",
        "share of new traces sampled, 0 to 1; a continued trace follows its caller (unset: OTEL_TRACES_SAMPLER_ARG, "
        "else 1)",
        type=float,
    ),
)


def common_flags(default_port: int, default_metrics_port: int) -> list[Flag]:
    """The flags every service has; each service picks its own default ports."""
    return [
        Flag("--host", "address to bind the gRPC and metrics servers to", default="127.0.0.1"),
        Flag("--port", "gRPC port (0: any free port)", default=default_port, type=int),
        Flag("--metrics-port", "Prometheus /metrics port (0: any free port)", default=default_metrics_port, type=int),
        Flag("--log-level", "log level", default="info", choices=("debug", "info", "warning", "error")),
        Flag("--grace-seconds", "on SIGTERM, how long in-flight RPCs may take to finish", default=30.0, type=float),
        *TLS_FLAGS,
        *TRACING_FLAGS,
    ]


def parse_bool(raw: str) -> bool:
    """A boolean flag's value as its environment variable spells it (1/0, true/false, yes/no, on/off)."""
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"expected one of {sorted(_TRUE | _FALSE)}")


def _shows_reason(convert: Callable[[str], Any]) -> Callable[[str], Any]:
    """``convert`` for argparse, which would replace a ValueError's reason by "invalid value"."""

    def parse(raw: str) -> Any:
        try:
            return convert(raw)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"invalid value {raw!r}: {e}") from None

    return parse


def parse_flags(
    prog: str,
    flags: Sequence[Flag],
    argv: Sequence[str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> argparse.Namespace:
    """Parse ``argv`` (default ``sys.argv[1:]``) with env fallbacks; exits 2 on a bad or missing value."""
    env = os.environ if environ is None else environ
    parser = argparse.ArgumentParser(prog=prog)
    for f in flags:
        shown = "" if f.default is None else f", default {f.default}"
        kwargs: dict[str, Any] = {"dest": f.dest, "default": None, "help": f"{f.help} [env {f.env_var}{shown}]"}
        if f.type is bool:
            parser.add_argument(f.name, action=argparse.BooleanOptionalAction, **kwargs)
        else:
            parser.add_argument(f.name, type=_shows_reason(f.type), choices=f.choices, **kwargs)
    # argparse's own `required` cannot see the environment, so presence is checked here.
    ns = parser.parse_args(argv)
    for f in flags:
        if getattr(ns, f.dest) is not None:
            continue
        raw = env.get(f.env_var, "")
        if raw:  # an empty variable (`KVMESH_X=` in a compose file) counts as unset
            try:
                value = parse_bool(raw) if f.type is bool else f.type(raw)
            except ValueError as exc:
                parser.error(f"{f.env_var}={raw!r} is not a valid {f.name}: {exc}")
            if f.choices is not None and value not in f.choices:
                parser.error(f"{f.env_var}={raw!r}: choose from {', '.join(map(str, f.choices))}")
        elif f.required:
            parser.error(f"missing required {f.name} (or set {f.env_var})")
        else:
            value = f.default
        setattr(ns, f.dest, value)
    return ns
