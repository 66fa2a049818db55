package kvmesh

import "context"

// apiKey is per-RPC credentials carrying a bearer API key in the
// "authorization" metadata the gateway checks.
type apiKey struct {
	header string
}

func newAPIKey(key string) apiKey {
	return apiKey{header: "Bearer " + key}
}

func (k apiKey) GetRequestMetadata(context.Context, ...string) (map[string]string, error) {
	return map[string]string{"authorization": k.header}, nil
}

// RequireTransportSecurity is false so that a local mesh's plaintext gRPC
// works; WithAPIKey's doc says what that costs.
func (k apiKey) RequireTransportSecurity() bool {
	return false
}
