package providers_test

import (
	"context"
	"testing"

	"go.uber.org/goleak"

	"github.com/waymark-dev/waymark/steps/providers"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// providerFunc adapts a function to providers.Provider.
type providerFunc func(ctx context.Context, req providers.Request) (providers.Reply, error)

func (f providerFunc) Complete(ctx context.Context, req providers.Request) (providers.Reply, error) {
	return f(ctx, req)
}
