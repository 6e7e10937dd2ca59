// Package raftmux lets many hashicorp/raft instances share one listening
// address: every Raft group a node hosts gets its own raft.StreamLayer from
// one Mux bound to the node's -raft-addr.
//
// A dialer names the group in a fixed 8-byte header, written before the
// first Raft RPC and inside TLS when the layer speaks it:
//
//	byte 0     0xA7 (never a hashicorp/raft RPC type, which are 0-4)
//	bytes 1-2  'r' 'g'
//	byte 3     version, 1
//	bytes 4-7  group id, big-endian uint32
//
// Group 0 dials without a header, and a connection whose first byte is not
// 0xA7 goes to group 0 with that byte replayed: a node that hosts only
// group 0 speaks exactly the protocol of a single-group node, in both
// directions, so single-group nodes and multi-group nodes interoperate on
// group 0 (a rolling upgrade). A tagged header for group 0 is accepted too.
// Bytes that neither start with 0xA7 nor are a Raft RPC reach group 0's
// transport, which closes the connection on the unknown RPC type, as a
// single-group node's does.
//
// The Mux owns one goroutine that accepts and one per connection until its
// header is read. A connection whose TLS handshake and header do not
// complete within Config.HeaderTimeout, whose header does not parse, or
// that names a group with no registered Stream is closed with a log line;
// so is every connection beyond Config.MaxPending still waiting for its
// header. A connection is handed to its group's Stream, whose Accept
// returns it to the group's raft.NetworkTransport; the Stream tracks it
// and closes it in Close, so the transport's handlers end with the group.
//
// With a tlsconfig.Loader, both directions speak mutual TLS and require an
// allocator-role certificate (tlsconfig.RoleAllocator) of the peer, as a
// single-group node's Raft port does.
//
// On Linux every TCP connection, accepted or dialed, reads and writes its
// non-blocking socket with raw system calls and waits for readiness in the
// runtime's poller (quietConn): an ordinary net.Conn call wakes the Go
// runtime's monitor thread when the process is otherwise idle, several
// times per Raft heartbeat, which made up about a third of an idle
// leader's CPU. Deadlines, Close and errors behave as net.Conn's.
//
// Mux and Stream are safe for concurrent use; Close on either is safe to
// call twice.
package raftmux
