package allocator

import (
	"context"
	"errors"

	"github.com/hashicorp/raft"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/allot/allot/allocator/state"
	"github.com/allot/allot/pkg/rules"
	allotv1 "github.com/allot/allot/proto/allot/v1"
)

// Errors the service returns before reaching Raft.
var (
	// errShutdown: the server is shutting down.
	errShutdown = errors.New("allocator: server is shutting down")
	// errNoLeader: no leader was known within the forward wait.
	errNoLeader = errors.New("allocator: no leader")
	// errForwardedNotLeader: a call forwarded to this node found it no longer
	// leading; it is not forwarded a second time.
	errForwardedNotLeader = errors.New("allocator: forwarded call reached a node that is not the leader")
	// errOverloaded: the leader's Acquire queue is full; nothing was
	// proposed.
	errOverloaded = errors.New("allocator: overloaded: the Acquire queue is full")
)

// ErrorInfo reasons and metadata keys carried by Unavailable statuses, so
// that clients can tell "not applied, retry anywhere" from "outcome unknown".
const (
	errorDomain = allotv1.ErrorDomain
	// ReasonNotLeader: the call was not applied; retrying is always safe.
	ReasonNotLeader = "NOT_LEADER"
	// ReasonLeadershipLost: the call may or may not have been applied;
	// retrying is safe for idempotent calls (Acquire with the same
	// request_id).
	ReasonLeadershipLost = "LEADERSHIP_LOST"
	// ReasonShuttingDown: the node is shutting down and did not propose the
	// call.
	ReasonShuttingDown = "SHUTTING_DOWN"
	// MetaLeaderID and MetaLeaderAddr are the ErrorInfo metadata keys of the
	// leader hint (the leader's node id and gRPC address), when one is known.
	MetaLeaderID   = allotv1.ErrorInfoLeaderID
	MetaLeaderAddr = allotv1.ErrorInfoLeaderAddr
)

// leaderHint is the leader known to this node when an error is returned.
type leaderHint struct {
	id, addr string
}

// toStatus maps an error to a gRPC status. It is the one place where Raft,
// state and rules errors become codes. Status errors (from a forwarded
// call) pass through unchanged.
func toStatus(err error, hint leaderHint) error {
	if err == nil {
		return nil
	}
	if _, ok := status.FromError(err); ok {
		return err
	}
	switch {
	case errors.Is(err, context.Canceled):
		return status.Error(codes.Canceled, err.Error())
	case errors.Is(err, context.DeadlineExceeded):
		return status.Error(codes.DeadlineExceeded, err.Error())

	// Not applied: safe to retry anywhere.
	case errors.Is(err, raft.ErrNotLeader),
		errors.Is(err, raft.ErrLeadershipTransferInProgress),
		errors.Is(err, raft.ErrEnqueueTimeout),
		errors.Is(err, errNoLeader),
		errors.Is(err, errForwardedNotLeader):
		return unavailable(err, ReasonNotLeader, hint)
	case errors.Is(err, errShutdown):
		return unavailable(err, ReasonShuttingDown, hint)
	case errors.Is(err, errOverloaded):
		return exhausted(ReasonOverloaded, overloadRetry, "%s; retry shortly", err.Error())
	// Outcome unknown: the entry may have been replicated before the loss.
	case errors.Is(err, raft.ErrLeadershipLost),
		errors.Is(err, raft.ErrRaftShutdown),
		errors.Is(err, raft.ErrAbortedByRestore):
		return unavailable(err, ReasonLeadershipLost, hint)

	case errors.Is(err, state.ErrInvalid):
		return status.Error(codes.InvalidArgument, err.Error())
	case errors.Is(err, state.ErrStaleRequest), errors.Is(err, state.ErrFailedPrecondition), errors.Is(err, state.ErrMoved):
		return status.Error(codes.FailedPrecondition, err.Error())
	case errors.Is(err, state.ErrUnknownAgent):
		return status.Error(codes.NotFound, err.Error())
	}
	var re *rules.Error
	if errors.As(err, &re) {
		return status.Error(codes.InvalidArgument, err.Error())
	}
	return status.Error(codes.Internal, err.Error())
}

func unavailable(err error, reason string, hint leaderHint) error {
	st := status.New(codes.Unavailable, err.Error())
	info := &errdetails.ErrorInfo{Reason: reason, Domain: errorDomain}
	if hint.id != "" {
		info.Metadata = map[string]string{MetaLeaderID: hint.id}
		if hint.addr != "" {
			info.Metadata[MetaLeaderAddr] = hint.addr
		}
	}
	if withInfo, derr := st.WithDetails(info); derr == nil {
		st = withInfo
	}
	return st.Err()
}

// statusReason returns the ErrorInfo reason of a status error ("" if none).
func statusReason(err error) string {
	st, ok := status.FromError(err)
	if !ok {
		return ""
	}
	for _, d := range st.Details() {
		if info, ok := d.(*errdetails.ErrorInfo); ok && info.Domain == errorDomain {
			return info.Reason
		}
	}
	return ""
}

// retryable reports whether a failed leader call may be tried again (on
// this node or forwarded). Errors that prove the call was not applied are
// always retryable; errors that leave the outcome unknown only for
// idempotent calls.
func retryable(err error, idempotent bool) bool {
	switch {
	case err == nil:
		return false
	case errors.Is(err, raft.ErrNotLeader),
		errors.Is(err, raft.ErrLeadershipTransferInProgress),
		errors.Is(err, raft.ErrEnqueueTimeout),
		errors.Is(err, errNoLeader):
		return true
	case errors.Is(err, raft.ErrLeadershipLost), errors.Is(err, raft.ErrRaftShutdown):
		return idempotent
	}
	if st, ok := status.FromError(err); ok && st.Code() == codes.Unavailable {
		switch statusReason(err) {
		case ReasonNotLeader:
			return true
		case ReasonShuttingDown:
			// The remote node is going away: it applied nothing.
			return true
		default:
			// A transport failure or lost leadership: outcome unknown.
			return idempotent
		}
	}
	return false
}
