package kvmesh

import (
	"crypto/tls"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
)

// Option configures Dial.
type Option func(*options)

type options struct {
	apiKey    string
	transport credentials.TransportCredentials
	extra     []grpc.DialOption
}

func defaultOptions() options {
	// A mesh serves plaintext gRPC on its own network; TLS is opt-in.
	return options{transport: insecure.NewCredentials()}
}

// WithAPIKey sends "authorization: Bearer <key>" with every call. Over the
// default plaintext transport the key travels unencrypted: use WithTLS
// anywhere but a trusted local network.
func WithAPIKey(key string) Option {
	return func(o *options) { o.apiKey = key }
}

// WithTLS connects over TLS (nil: the system's roots and defaults).
func WithTLS(cfg *tls.Config) Option {
	return func(o *options) { o.transport = credentials.NewTLS(cfg) }
}

// WithDialOptions passes extra options to grpc.NewClient (interceptors,
// keepalive, message size limits...).
func WithDialOptions(opts ...grpc.DialOption) Option {
	return func(o *options) { o.extra = append(o.extra, opts...) }
}
