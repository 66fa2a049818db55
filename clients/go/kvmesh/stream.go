package kvmesh

import (
	"context"
	"errors"
	"io"
	"iter"

	"google.golang.org/grpc"
)

// stream turns a server-streaming call into an iterator. The call runs under
// its own child context, cancelled when the loop ends for any reason, so a
// caller that stops ranging early cancels the RPC and the gateway frees the
// request instead of generating into the void.
func stream[T any](
	ctx context.Context,
	open func(context.Context) (grpc.ServerStreamingClient[T], error),
) iter.Seq2[*T, error] {
	return func(yield func(*T, error) bool) {
		ctx, cancel := context.WithCancel(ctx)
		defer cancel()
		s, err := open(ctx)
		if err != nil {
			yield(nil, err)
			return
		}
		for {
			msg, err := s.Recv()
			if errors.Is(err, io.EOF) {
				return
			}
			if err != nil {
				yield(nil, err)
				return
			}
			if !yield(msg, nil) {
				return
			}
		}
	}
}
