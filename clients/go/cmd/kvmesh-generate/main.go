// Command kvmesh-generate streams one completion from a kvmesh gateway to
// stdout, then prints the finish reason and token counts to stderr.
//
//	go run ./cmd/kvmesh-generate -addr 127.0.0.1:50051 -prompt "Once upon a time" -max-tokens 64
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"

	"google.golang.org/protobuf/proto"

	commonv1 "github.com/kvmesh/kvmesh/clients/go/gen/kvmesh/api/common/v1"
	gatewayv1 "github.com/kvmesh/kvmesh/clients/go/gen/kvmesh/api/gateway/v1"
	"github.com/kvmesh/kvmesh/clients/go/kvmesh"
)

func main() {
	addr := flag.String("addr", "127.0.0.1:50051", "the gateway's gRPC address")
	prompt := flag.String("prompt", "Hello", "the prompt to complete")
	maxTokens := flag.Uint("max-tokens", 64, "most tokens to generate")
	temperature := flag.Float64("temperature", 0, "sampling temperature (0: greedy)")
	apiKey := flag.String("api-key", os.Getenv("KVMESH_API_KEY"), "API key (default: $KVMESH_API_KEY)")
	flag.Parse()

	if err := run(*addr, *apiKey, *prompt, uint32(*maxTokens), float32(*temperature)); err != nil {
		fmt.Fprintln(os.Stderr, "kvmesh-generate:", err)
		os.Exit(1)
	}
}

func run(addr, apiKey, prompt string, maxTokens uint32, temperature float32) error {
	var opts []kvmesh.Option
	if apiKey != "" {
		opts = append(opts, kvmesh.WithAPIKey(apiKey))
	}
	client, err := kvmesh.Dial(addr, opts...)
	if err != nil {
		return err
	}
	defer client.Close()

	// Ctrl-C cancels the stream, and with it the generation on the server.
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()

	req := &gatewayv1.GenerateRequest{
		Prompt:   &gatewayv1.GenerateRequest_Text{Text: prompt},
		Sampling: &commonv1.SamplingParams{MaxTokens: maxTokens, Temperature: proto.Float32(temperature)},
	}
	for chunk, err := range client.Generate(ctx, req) {
		if err != nil {
			return err
		}
		fmt.Print(chunk.GetText())
		if end := chunk.GetFinal(); end != nil {
			fmt.Println()
			fmt.Fprintf(os.Stderr, "finish: %s, prompt tokens: %d, completion tokens: %d\n",
				end.GetFinishReason(), end.GetUsage().GetPromptTokens(), end.GetUsage().GetCompletionTokens())
		}
	}
	return nil
}
