package kvmesh

import (
	"context"
	"iter"

	"google.golang.org/grpc"

	gatewayv1 "github.com/kvmesh/kvmesh/clients/go/gen/kvmesh/api/gateway/v1"
)

// Client calls one kvmesh gateway. It is safe for concurrent use; Close it
// when done.
type Client struct {
	conn *grpc.ClientConn
	api  gatewayv1.GatewayServiceClient
}

// Dial makes a client for the gateway at addr ("host:port"). Like
// grpc.NewClient it does not wait for the connection: the first call does.
func Dial(addr string, opts ...Option) (*Client, error) {
	o := defaultOptions()
	for _, opt := range opts {
		opt(&o)
	}
	dial := []grpc.DialOption{grpc.WithTransportCredentials(o.transport)}
	if o.apiKey != "" {
		dial = append(dial, grpc.WithPerRPCCredentials(newAPIKey(o.apiKey)))
	}
	conn, err := grpc.NewClient(addr, append(dial, o.extra...)...)
	if err != nil {
		return nil, err
	}
	return &Client{conn: conn, api: gatewayv1.NewGatewayServiceClient(conn)}, nil
}

// Close closes the connection; calls in flight fail with codes.Canceled.
func (c *Client) Close() error {
	return c.conn.Close()
}

// API is the generated client, for what this package does not wrap.
func (c *Client) API() gatewayv1.GatewayServiceClient {
	return c.api
}

// Generate completes a prompt, yielding the response chunks as they arrive.
// The last chunk carries Final (finish reason, usage, timings). A failed call
// yields one (nil, err) pair and stops.
func (c *Client) Generate(ctx context.Context, req *gatewayv1.GenerateRequest) iter.Seq2[*gatewayv1.GenerateResponse, error] {
	return stream(ctx, func(ctx context.Context) (grpc.ServerStreamingClient[gatewayv1.GenerateResponse], error) {
		return c.api.Generate(ctx, req)
	})
}

// Chat completes a conversation (the model's chat template is applied),
// yielding chunks as Generate does.
func (c *Client) Chat(ctx context.Context, req *gatewayv1.ChatRequest) iter.Seq2[*gatewayv1.ChatResponse, error] {
	return stream(ctx, func(ctx context.Context) (grpc.ServerStreamingClient[gatewayv1.ChatResponse], error) {
		return c.api.Chat(ctx, req)
	})
}

// Tokenize returns the token ids of text under the served model's tokenizer,
// with its special tokens (e.g. BOS) added.
func (c *Client) Tokenize(ctx context.Context, text string) ([]uint32, error) {
	resp, err := c.api.Tokenize(ctx, &gatewayv1.TokenizeRequest{
		Input:            &gatewayv1.TokenizeRequest_Text{Text: text},
		AddSpecialTokens: true,
	})
	if err != nil {
		return nil, err
	}
	return resp.GetTokenIds(), nil
}

// ListModels returns the models the gateway serves.
func (c *Client) ListModels(ctx context.Context) ([]*gatewayv1.ModelInfo, error) {
	resp, err := c.api.ListModels(ctx, &gatewayv1.ListModelsRequest{})
	if err != nil {
		return nil, err
	}
	return resp.GetModels(), nil
}
