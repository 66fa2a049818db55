#!/bin/sh
# The image's entry point: `kvmesh "$@"` (`router`, `decode`, ... or any kvmesh command).
#
# A worker registers with the router under the address others dial to reach it.
# Inside a container it binds 0.0.0.0, which nobody can dial, and replicas of
# one compose service share a DNS name, so unless KVMESH_ADVERTISE_ADDRESS is
# set, each container advertises its own IP and KVMESH_PORT (services without
# that flag ignore the variable).
set -eu
if [ -z "${KVMESH_ADVERTISE_ADDRESS:-}" ] && [ -n "${KVMESH_PORT:-}" ]; then
    ip=$(python3 -c 'import socket; print(socket.gethostbyname(socket.gethostname()))')
    export KVMESH_ADVERTISE_ADDRESS="$ip:$KVMESH_PORT"
fi
exec kvmesh "$@"
