package testproc

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"net/http"
	"os"
	"path/filepath"
)

// AdminToken writes a fresh admin token file into dir and returns the
// allocator flags that use it (-admin-token-file, and -pprof: the
// benchmarks profile the nodes, which pprof allows only to an admin token)
// and the token. Agents still lease without it; admin calls and pprof
// requests must carry it (Bearer, GetWithToken).
func AdminToken(dir string) (args []string, token string, err error) {
	b := make([]byte, 24)
	if _, err := rand.Read(b); err != nil {
		return nil, "", err
	}
	token = hex.EncodeToString(b)
	path := filepath.Join(dir, "admin-tokens")
	if err := os.WriteFile(path, []byte(token+"\n"), 0o600); err != nil {
		return nil, "", err
	}
	return []string{"-admin-token-file", path, "-pprof"}, token, nil
}

// Bearer sends an admin token as gRPC "authorization: Bearer" metadata
// (grpc.WithPerRPCCredentials), over plaintext loopback too.
type Bearer string

// GetRequestMetadata implements credentials.PerRPCCredentials.
func (b Bearer) GetRequestMetadata(context.Context, ...string) (map[string]string, error) {
	return map[string]string{"authorization": "Bearer " + string(b)}, nil
}

// RequireTransportSecurity implements credentials.PerRPCCredentials.
func (Bearer) RequireTransportSecurity() bool { return false }

// GetWithToken GETs url with "Authorization: Bearer token" (pprof).
func GetWithToken(ctx context.Context, url, token string) (*http.Response, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return nil, err
	}
	req.Header.Set("Authorization", "Bearer "+token)
	return http.DefaultClient.Do(req)
}
