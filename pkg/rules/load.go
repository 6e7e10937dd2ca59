package rules

import (
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
)

// LoadFiles reads rules files and compiles them. A path that names a
// directory contributes every *.yaml and *.yml file directly in it (not
// hidden ones), sorted by name, as Envoy's runtime directory does. Any error
// rejects the whole set; callers that hot-reload keep their previous Set.
func LoadFiles(version uint64, paths ...string) (*Set, error) {
	files, err := ReadFiles(paths...)
	if err != nil {
		return nil, err
	}
	return Compile(version, files)
}

// ReadFiles reads rules files (and directories of them, as LoadFiles does)
// without compiling them, for callers that send the sources elsewhere (for
// example allotctl to the allocator).
func ReadFiles(paths ...string) ([]File, error) {
	var files []File
	for _, p := range paths {
		st, err := os.Stat(p)
		if err != nil {
			return nil, fmt.Errorf("rules: %w", err)
		}
		names := []string{p}
		if st.IsDir() {
			ents, err := os.ReadDir(p)
			if err != nil {
				return nil, fmt.Errorf("rules: %w", err)
			}
			names = names[:0]
			for _, e := range ents {
				n := e.Name()
				if e.IsDir() || strings.HasPrefix(n, ".") {
					continue
				}
				if ext := filepath.Ext(n); ext == ".yaml" || ext == ".yml" {
					names = append(names, filepath.Join(p, n))
				}
			}
			sort.Strings(names)
		}
		for _, n := range names {
			src, err := os.ReadFile(n)
			if err != nil {
				return nil, fmt.Errorf("rules: %w", err)
			}
			files = append(files, File{Name: n, Source: src})
		}
	}
	return files, nil
}
