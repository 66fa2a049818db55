package kvmesh

import (
	"context"
	"testing"
)

func TestAPIKeyIsABearerAuthorizationHeader(t *testing.T) {
	md, err := newAPIKey("s3cret").GetRequestMetadata(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if len(md) != 1 || md["authorization"] != "Bearer s3cret" {
		t.Fatalf("metadata %v", md)
	}
}
