package rls

import (
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"strconv"

	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protojson"

	"github.com/allot/allot/agent/httplimit"
)

// DefaultMaxJSONBytes bounds a POST /json body when JSONHandler is given 0.
const DefaultMaxJSONBytes = 64 << 10

// JSONPath is the path envoyproxy/ratelimit serves its JSON endpoint on.
const JSONPath = "/json"

// JSONHandler returns the handler of POST /json, envoyproxy/ratelimit's
// endpoint for clients that cannot speak gRPC: the body is the protojson of
// a RateLimitRequest, the answer the protojson of the RateLimitResponse
// that ShouldRateLimit gives (the same code path).
//
//   - 200 when the overall code is OK, 429 when OVER_LIMIT, with the
//     RateLimit and RateLimit-Policy fields as the proxy sets them (and
//     Retry-After on a 429), Cache-Control: no-store.
//   - 400 with {"error":"bad_request","message":...} for a body that does
//     not parse (the message is the parse error) or a request
//     ShouldRateLimit refuses (InvalidArgument).
//   - 413 for a body over maxBody bytes (0: DefaultMaxJSONBytes).
//   - 405 for a method other than POST; 503 when the agent cannot decide.
//
// The body is not logged: it may carry API keys.
func (s *Server) JSONHandler(maxBody int64) http.Handler {
	if maxBody <= 0 {
		maxBody = DefaultMaxJSONBytes
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodPost {
			w.Header().Set("Allow", http.MethodPost)
			writeJSONError(w, http.StatusMethodNotAllowed, "method_not_allowed", "use POST")
			return
		}
		if r.ContentLength > maxBody {
			s.byCode[outInvalid].Inc()
			writeJSONError(w, http.StatusRequestEntityTooLarge, "too_large", "the body is over "+strconv.FormatInt(maxBody, 10)+" bytes")
			return
		}
		body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, maxBody))
		if err != nil {
			s.byCode[outInvalid].Inc()
			var tooLarge *http.MaxBytesError
			if errors.As(err, &tooLarge) {
				writeJSONError(w, http.StatusRequestEntityTooLarge, "too_large", "the body is over "+strconv.FormatInt(maxBody, 10)+" bytes")
				return
			}
			writeJSONError(w, http.StatusBadRequest, "bad_request", "reading the body: "+err.Error())
			return
		}
		req := new(rlsv3.RateLimitRequest)
		if err := protojson.Unmarshal(body, req); err != nil {
			s.byCode[outInvalid].Inc()
			writeJSONError(w, http.StatusBadRequest, "bad_request", err.Error())
			return
		}
		resp, dec, err := s.decide(r.Context(), req)
		if err != nil {
			st := status.Convert(err)
			switch st.Code() {
			case codes.InvalidArgument:
				writeJSONError(w, http.StatusBadRequest, "bad_request", st.Message())
			case codes.Unavailable:
				writeJSONError(w, http.StatusServiceUnavailable, "unavailable", st.Message())
			default:
				writeJSONError(w, http.StatusInternalServerError, "internal", st.Message())
			}
			return
		}
		out, err := protojson.Marshal(resp)
		if err != nil {
			writeJSONError(w, http.StatusInternalServerError, "internal", "encoding the response: "+err.Error())
			return
		}
		h := w.Header()
		httplimit.SetFields(h, dec, nil)
		h.Set("Content-Type", "application/json")
		h.Set("Cache-Control", "no-store")
		h.Set("Content-Length", strconv.Itoa(len(out)))
		code := http.StatusOK
		if resp.GetOverallCode() == rlsv3.RateLimitResponse_OVER_LIMIT {
			code = http.StatusTooManyRequests
			h.Set("Retry-After", strconv.FormatInt(httplimit.RetryAfterSeconds(dec), 10))
		}
		w.WriteHeader(code)
		_, _ = w.Write(out)
	})
}

// writeJSONError writes {"error": kind, "message": msg} with code.
func writeJSONError(w http.ResponseWriter, code int, kind, msg string) {
	// encoding/json: msg may be a parse error quoting arbitrary input bytes.
	body, _ := json.Marshal(struct {
		Error   string `json:"error"`
		Message string `json:"message"`
	}{kind, msg})
	h := w.Header()
	h.Set("Content-Type", "application/json")
	h.Set("Cache-Control", "no-store")
	h.Set("Content-Length", strconv.Itoa(len(body)))
	w.WriteHeader(code)
	_, _ = w.Write(body)
}
