// Package k8svalidate holds only tests: they decode every manifest under
// deploy/kubernetes strictly into the Kubernetes API types (k8s.io/api), so
// a misspelled or misplaced field fails, and check the properties the
// manifests promise (one allocator voter per node, gateways spread over
// nodes, the allocators' HTTP port on no Service, the NetworkPolicy's
// ingress). It is its own Go module so that k8s.io/api and its
// dependencies stay out of allot's main module; `make test` runs it.
package k8svalidate
