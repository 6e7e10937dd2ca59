// Package layers holds the test that keeps the package graph as
// docs/architecture.md draws it: every package is in the layer table,
// imports only packages of lower layers, allocator and agent never import
// each other, nothing imports cmd/, and the tree has no symlinks.
package layers
