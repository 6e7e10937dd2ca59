package testproc

import (
	"os"
	"os/exec"
	"testing"
)

// Required reports whether tests must fail, not skip, when a tool they need
// is missing: in CI (CI=true, or ALLOT_REQUIRE_TOOLS=1, which .ci/run sets
// after installing the tools).
func Required() bool {
	return os.Getenv("ALLOT_REQUIRE_TOOLS") == "1" || os.Getenv("CI") == "true"
}

// Missing skips the test with why, or fails it when Required.
func Missing(t testing.TB, why string) {
	t.Helper()
	if Required() {
		t.Fatalf("%s (required in CI: .ci/run installs it)", why)
	}
	t.Skip(why)
}

// Tool returns the path of the executable name (e.g. promtool, python3),
// skipping the test without it locally and failing it in CI (Required).
func Tool(t testing.TB, name string) string {
	t.Helper()
	p, err := exec.LookPath(name)
	if err != nil {
		Missing(t, name+" is not installed")
	}
	return p
}

// PythonModule returns python3's path after checking that it imports
// module, under the same rule as Tool.
// The python3 on PATH is tried first, then the system's /usr/bin/python3
// (where Debian's python3-* packages install, when PATH leads to another
// interpreter first).
func PythonModule(t testing.TB, module string) string {
	t.Helper()
	var why string
	for _, name := range []string{"python3", "/usr/bin/python3"} {
		py, err := exec.LookPath(name)
		if err != nil {
			continue
		}
		out, err := exec.Command(py, "-c", "import "+module).CombinedOutput()
		if err == nil {
			return py
		}
		why = py + " cannot import " + module + ": " + string(out)
	}
	if why == "" {
		why = "python3 is not installed"
	}
	Missing(t, why)
	return ""
}
