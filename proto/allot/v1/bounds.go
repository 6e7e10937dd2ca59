package allotv1

// The protocol's input bounds, written by hand beside the generated code:
// the allocator rejects a request beyond them (InvalidArgument), and the
// agent and clients size their requests to fit them.
const (
	// MaxIDBytes bounds an agent id (AcquireRequest.agent_id) and a node
	// id, in bytes.
	MaxIDBytes = 256
	// MaxKeysPerCall bounds the keys of one Acquire or Release and the
	// descriptors of one Check.
	MaxKeysPerCall = 1000
	// MaxKeyBytes bounds one key: its domain plus, per entry, the key and
	// the value and 2 bytes of separators.
	MaxKeyBytes = 4096
	// MaxAmount bounds every token count and demand of a request (want,
	// held, returned, charged, denied, demand).
	MaxAmount = 1e12
	// MaxRulesBytes bounds the total YAML of one PutRules.
	MaxRulesBytes = 1 << 26
	// MaxRuleFiles bounds the files of one PutRules.
	MaxRuleFiles = 10_000
	// MaxPageSize bounds a ListLeases page and a TopKeys answer.
	MaxPageSize = 1000
)
