// Package groupdir lays out a multi-group allocator's data directory and
// refuses one that does not belong to the node:
//
//	<data-dir>/cluster.json           {"format":1,"cluster_id":"…","node_id":"…"}
//	<data-dir>/groups/<id>/group.json {"format":1,"cluster_id":"…","group":<id>}
//	<data-dir>/groups/<id>/…          the group's raft.db (or wal/), snapshots/ and watermark
//
// Init writes cluster.json for a new node (bootstrapping or joining);
// Open reads it back at a restart, and Layout.Check compares it with the
// cluster and node the node is started as. CreateGroup makes a group's
// directory atomically (built as <id>.tmp, then renamed); OpenGroup
// refuses a missing directory, or one whose group.json names another
// cluster or group, with an error naming the path; CheckGroups does that
// for every group the node hosts. A data dir of a single-group node (raft.db
// or wal/ at its root, no cluster.json) is refused with ErrLegacy until
// MigrateLegacy moves its files into groups/0/; the migration resumes
// where it stopped if the node dies during it.
//
// Every error wraps one of the sentinels and names the path concerned.
// Files are written durably: a temporary file, fsync, rename, fsync of the
// directory. A Layout is a value describing paths; it is safe for
// concurrent use, but the directory operations must not race each other.
package groupdir
