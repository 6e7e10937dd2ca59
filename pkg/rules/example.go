package rules

import _ "embed"

// ExampleYAML is the example rules file (domain public-api): premium
// keys get 1000/minute with burst 200, free keys 30/minute with burst 10 on
// /v1/search, and k_live_abc123 dark-launches a 5/minute per-key limit in
// shadow mode in place of its tier limit. The gateway's -dev mode loads it;
// docs/rules.md explains it. It is the same text as
// testdata/public-api.yaml.
//
//go:embed example.yaml
var ExampleYAML string

// ExampleName is the file name ExampleFiles uses for ExampleYAML.
const ExampleName = "public-api.yaml"

// ExampleFiles returns ExampleYAML as the single File of a rule set, ready
// for Compile.
func ExampleFiles() []File {
	return []File{{Name: ExampleName, Domain: "public-api", Source: []byte(ExampleYAML)}}
}
