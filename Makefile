# allot build, test and tooling entry points. `make help` lists them.
GO        ?= go
BIN       ?= bin
PKGS      ?= ./...
TESTFLAGS ?= -race -count=1 -timeout 20m
# Modules of their own (heavy test-only dependencies kept out of go.mod).
SUBMODULES := deploy/k8svalidate integrations/caddy
# integrations/caddy's tests build Caddy; run without -race, its test binary
# reuses that build's compiled dependencies (race-instrumenting Caddy's tree
# cost 3 CPU-minutes more, measured).
NORACE_SUBMODULES := integrations/caddy
SUBMODULE_TESTFLAGS = $(if $(filter $(1),$(NORACE_SUBMODULES)),$(filter-out -race,$(TESTFLAGS)),$(TESTFLAGS))
BENCHTIME ?= 1s

.PHONY: help build test test-short bench bench-load sim lint fmt proto pgo dev clean tools

help: ## list targets
	@grep -E '^[a-z-]+:.*##' $(MAKEFILE_LIST) | sed 's/:.*## /\t/'

build: ## build allocator, gateway and allotctl into ./bin
	@mkdir -p $(BIN)
	$(GO) build -o $(BIN)/ ./cmd/...

test: ## run every test with the race detector (the sub-modules' too)
	$(GO) test $(TESTFLAGS) $(PKGS)
	@$(foreach m,$(SUBMODULES),echo "cd $(m) && $(GO) test $(call SUBMODULE_TESTFLAGS,$(m)) ./..." && (cd $(m) && $(GO) test $(call SUBMODULE_TESTFLAGS,$(m)) ./...) &&) true

test-short: ## the quick subset (no multi-process clusters)
	$(GO) test -short $(TESTFLAGS) $(PKGS)
	@$(foreach m,$(SUBMODULES),(cd $(m) && $(GO) test -short $(call SUBMODULE_TESTFLAGS,$(m)) ./...) &&) true

bench: ## micro-benchmarks (algorithms, matcher, agent hot path) side by side with baselines
	$(GO) test -run '^$$' -bench . -benchmem -benchtime $(BENCHTIME) ./pkg/... ./agent/...

bench-load: build ## the load harness: 3 allocators + agents on loopback (see docs/performance.md)
	$(GO) run ./bench/load $(ARGS)

sim: ## the quick fleet simulation (see docs/performance.md)
	$(GO) run ./bench/sim -quick $(ARGS)

lint: ## go vet, a gofmt check and a tidy go.mod (the sub-modules' too)
	$(GO) vet $(PKGS)
	@$(GO) mod tidy -diff >/dev/null || { echo "go mod tidy would change go.mod/go.sum: run it"; $(GO) mod tidy -diff; exit 1; }
	@for m in $(SUBMODULES); do \
	  (cd $$m && $(GO) vet ./... && { $(GO) mod tidy -diff >/dev/null || { echo "$$m: go mod tidy would change go.mod/go.sum: run it"; exit 1; }; }) || exit 1; \
	done
	@out=$$(gofmt -l $$(git ls-files '*.go' | grep -v '\.pb\.go$$')); \
	if [ -n "$$out" ]; then echo "gofmt would change:"; echo "$$out"; exit 1; fi

fmt: ## gofmt the tree
	gofmt -w $$(git ls-files '*.go' | grep -v '\.pb\.go$$')

tools: ## install the protoc plugins at the pinned versions
	$(GO) install google.golang.org/protobuf/cmd/protoc-gen-go@v1.36.12
	$(GO) install google.golang.org/grpc/cmd/protoc-gen-go-grpc@v1.6.2

proto: ## regenerate proto/ (needs protoc from Debian's protobuf-compiler, and `make tools`)
	PATH="$$($(GO) env GOPATH)/bin:$$PATH" protoc -I proto \
	  --go_out=proto --go_opt=paths=source_relative \
	  --go-grpc_out=proto --go-grpc_opt=paths=source_relative \
	  proto/allot/v1/allot.proto

pgo: ## regenerate cmd/allocator/default.pgo (the profile go build optimises the allocator with) from bench/acquire runs
	@dir=$$(mktemp -d) && n=0 && \
	$(GO) build -o $$dir/allocator ./cmd/allocator && \
	for run in "-rate 200000 -keys-per-call 1000" "-rate 20000" "-mode fleet -rate 200000 -keys-per-call 1000"; do \
	  n=$$((n+1)); \
	  $(GO) run ./bench/acquire -bin $$dir/allocator -duration 15s -failovers 0 $$run \
	    -leader-cpuprofile $$dir/leader-$$n.prof -follower-cpuprofile $$dir/follower-$$n.prof >/dev/null || exit 1; \
	done && \
	$(GO) tool pprof -proto $$dir/*.prof > $$dir/merged.pgo && mv $$dir/merged.pgo cmd/allocator/default.pgo && rm -rf $$dir

dev: ## run the gateway in -dev mode (embedded allocator, demo upstream, demo rules)
	$(GO) run ./cmd/gateway -dev

clean:
	rm -rf $(BIN)
