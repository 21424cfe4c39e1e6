package client

import (
	"context"
	"net/http"

	"github.com/sbxbroker/broker/protocol"
)

// Limits reads the org's limits and what it uses of them now.
func (c *Client) Limits(ctx context.Context) (protocol.LimitsResponse, error) {
	var out protocol.LimitsResponse
	err := c.do(ctx, http.MethodGet, "/v1/limits", nil, nil, &out)
	return out, err
}
