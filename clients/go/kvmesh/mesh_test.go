package kvmesh_test

// These tests run against a live mesh (tests/clients/test_go_client.py starts
// one and sets the variables below); without it they skip.

import (
	"bufio"
	"context"
	"errors"
	"net/http"
	"os"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	commonv1 "github.com/kvmesh/kvmesh/clients/go/gen/kvmesh/api/common/v1"
	gatewayv1 "github.com/kvmesh/kvmesh/clients/go/gen/kvmesh/api/gateway/v1"
	"github.com/kvmesh/kvmesh/clients/go/kvmesh"
)

type mesh struct {
	addr, apiKey, metricsURL string
}

func liveMesh(t *testing.T) mesh {
	t.Helper()
	m := mesh{
		addr:       os.Getenv("KVMESH_GATEWAY_ADDRESS"),
		apiKey:     os.Getenv("KVMESH_API_KEY"),
		metricsURL: os.Getenv("KVMESH_METRICS_URL"),
	}
	if m.addr == "" || m.apiKey == "" || m.metricsURL == "" {
		t.Skip("no mesh: set KVMESH_GATEWAY_ADDRESS, KVMESH_API_KEY and KVMESH_METRICS_URL (tests/clients/test_go_client.py does)")
	}
	return m
}

func (m mesh) client(t *testing.T, key string) *kvmesh.Client {
	t.Helper()
	c, err := kvmesh.Dial(m.addr, kvmesh.WithAPIKey(key))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// A greedy completion of exactly n tokens.
func request(n uint32) *gatewayv1.GenerateRequest {
	return &gatewayv1.GenerateRequest{
		Prompt:   &gatewayv1.GenerateRequest_Text{Text: "the quick brown fox jumps over the lazy dog"},
		Sampling: &commonv1.SamplingParams{Temperature: proto.Float32(0), MaxTokens: n, IgnoreEos: true},
	}
}

// The gateway's kvmesh_gateway_inflight_requests gauge.
func (m mesh) inflight(t *testing.T) float64 {
	t.Helper()
	resp, err := http.Get(m.metricsURL)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	lines := bufio.NewScanner(resp.Body)
	for lines.Scan() {
		if v, ok := strings.CutPrefix(lines.Text(), "kvmesh_gateway_inflight_requests "); ok {
			f, err := strconv.ParseFloat(v, 64)
			if err != nil {
				t.Fatal(err)
			}
			return f
		}
	}
	t.Fatalf("no kvmesh_gateway_inflight_requests in %s", m.metricsURL)
	return 0
}

// Polls the gauge until it reads want; the bound only guards against hanging.
func (m mesh) waitInflight(t *testing.T, want float64) {
	t.Helper()
	var got float64
	for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		if got = m.inflight(t); got == want {
			return
		}
	}
	t.Fatalf("kvmesh_gateway_inflight_requests = %v, want %v", got, want)
}

// holdDecode stops the mesh's decode worker (SIGSTOP) until the test ends, so a request sent
// meanwhile stays in flight until the test cancels it: the test mesh's tiny model answers 400
// tokens faster than a loaded machine schedules a cancel sent mid-stream.
func (m mesh) holdDecode(t *testing.T) {
	t.Helper()
	pid, err := strconv.Atoi(os.Getenv("KVMESH_DECODE_PID"))
	if err != nil {
		t.Skip("no decode worker to hold: set KVMESH_DECODE_PID (tests/clients/test_go_client.py does)")
	}
	if err := syscall.Kill(pid, syscall.SIGSTOP); err != nil {
		t.Fatalf("stopping decode worker %d: %v", pid, err)
	}
	t.Cleanup(func() {
		if err := syscall.Kill(pid, syscall.SIGCONT); err != nil {
			t.Errorf("resuming decode worker %d: %v", pid, err)
		}
	})
}

func TestGenerateStreamsIncrementallyAndEndsWithUsage(t *testing.T) {
	m := liveMesh(t)
	c := m.client(t, m.apiKey)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	var messages, tokens int
	var end *gatewayv1.StreamEnd
	for chunk, err := range c.Generate(ctx, request(24)) {
		if err != nil {
			t.Fatal(err)
		}
		if end != nil {
			t.Fatal("a chunk after the final one")
		}
		if int(chunk.GetOffset()) != tokens {
			t.Fatalf("chunk %d: offset %d, want %d (the tokens received so far)", messages, chunk.GetOffset(), tokens)
		}
		messages++
		tokens += len(chunk.GetTokenIds())
		end = chunk.GetFinal()
	}
	if messages < 2 {
		t.Fatalf("%d message(s): the tokens did not stream", messages)
	}
	if end == nil {
		t.Fatal("the stream ended without a final chunk")
	}
	if tokens != 24 || int(end.GetUsage().GetCompletionTokens()) != tokens {
		t.Fatalf("received %d tokens, usage says %d, asked for 24", tokens, end.GetUsage().GetCompletionTokens())
	}
	if end.GetFinishReason() != commonv1.FinishReason_FINISH_REASON_LENGTH {
		t.Fatalf("finish reason %v", end.GetFinishReason())
	}
}

func TestCancelledContextStopsTheStreamAndFreesTheRequest(t *testing.T) {
	m := liveMesh(t)
	c := m.client(t, m.apiKey)
	m.waitInflight(t, 0)
	m.holdDecode(t)

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	ended := make(chan error, 1)
	go func() {
		for chunk, err := range c.Generate(ctx, request(400)) {
			if err != nil {
				ended <- err
				return
			}
			if chunk.GetFinal() != nil {
				ended <- errors.New("the generation finished before it was cancelled")
				return
			}
		}
		ended <- errors.New("the stream ended without an error")
	}()
	// The request is running on the server (its decode is held): the gauge counts it.
	m.waitInflight(t, 1)
	cancel()
	if err := <-ended; status.Code(err) != codes.Canceled {
		t.Fatalf("stream ended with %v, want codes.Canceled", err)
	}
	// The gateway frees the request without waiting for the held worker.
	m.waitInflight(t, 0)
}

func TestWrongAPIKeyIsUnauthenticated(t *testing.T) {
	m := liveMesh(t)
	c := m.client(t, "not-"+m.apiKey)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	for _, err := range c.Generate(ctx, request(4)) {
		if status.Code(err) != codes.Unauthenticated {
			t.Fatalf("Generate with a wrong key: %v, want codes.Unauthenticated", err)
		}
	}
	if _, err := c.Tokenize(ctx, "hello"); status.Code(err) != codes.Unauthenticated {
		t.Fatalf("Tokenize with a wrong key: %v, want codes.Unauthenticated", err)
	}
}

func TestUnaryCallsAndChat(t *testing.T) {
	m := liveMesh(t)
	c := m.client(t, m.apiKey)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	models, err := c.ListModels(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(models) != 1 || models[0].GetMaxModelLen() == 0 {
		t.Fatalf("ListModels: %v", models)
	}
	ids, err := c.Tokenize(ctx, "hello world")
	if err != nil {
		t.Fatal(err)
	}
	if len(ids) == 0 {
		t.Fatal("Tokenize returned no tokens")
	}

	chat := &gatewayv1.ChatRequest{
		Model:    models[0].GetId(),
		Messages: []*gatewayv1.ChatMessage{{Role: "user", Content: "hello"}},
		Sampling: &commonv1.SamplingParams{Temperature: proto.Float32(0), MaxTokens: 8, IgnoreEos: true},
	}
	tokens := 0
	var end *gatewayv1.StreamEnd
	for chunk, err := range c.Chat(ctx, chat) {
		if err != nil {
			t.Fatal(err)
		}
		tokens += len(chunk.GetTokenIds())
		end = chunk.GetFinal()
	}
	if end == nil || int(end.GetUsage().GetCompletionTokens()) != tokens || tokens != 8 {
		t.Fatalf("chat: %d tokens, final %v", tokens, end)
	}
}

// A deadline from the context reaches the call as codes.DeadlineExceeded.
func TestDeadlineFromContext(t *testing.T) {
	m := liveMesh(t)
	c := m.client(t, m.apiKey)
	ctx, cancel := context.WithDeadline(context.Background(), time.Now().Add(-time.Second))
	defer cancel()
	_, err := c.ListModels(ctx)
	if status.Code(err) != codes.DeadlineExceeded {
		t.Fatalf("ListModels past its deadline: %v", err)
	}
}
