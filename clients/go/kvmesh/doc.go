// Package kvmesh is a small client for kvmesh's public gRPC API
// (kvmesh.api.gateway.v1.GatewayService), on top of the code generated from
// protos/ into github.com/kvmesh/kvmesh/clients/go/gen.
//
// Streams are Go iterators: ranging over Generate or Chat yields chunks as the
// gateway sends them; leaving the loop early, or cancelling the context,
// cancels the call and the gateway stops generating. Deadlines come from the
// context. Errors are gRPC status errors: inspect them with
// status.Code(err) (e.g. codes.Unauthenticated for a wrong API key).
package kvmesh
