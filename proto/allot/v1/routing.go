package allotv1

// LeaderAddrHeader is the gRPC response header through which a follower
// that forwarded an Acquire or a Release to the leader names the leader's
// gRPC address (as advertised in its member record). A caller that sends
// its next calls there skips the follower's hop; the header is absent on
// answers the leader gave itself. Written by hand beside the generated
// code, like the bounds.
const LeaderAddrHeader = "x-allot-leader-addr"

// The leader hint of an Unavailable status: an errdetails.ErrorInfo of
// ErrorDomain whose metadata names the leader's node id (ErrorInfoLeaderID)
// and, once the leader registered it, its gRPC address
// (ErrorInfoLeaderAddr). A caller retries the call there.
const (
	ErrorDomain         = "allot.v1"
	ErrorInfoLeaderID   = "leader_id"
	ErrorInfoLeaderAddr = "leader_addr"
)
