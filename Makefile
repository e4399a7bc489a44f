# Conveniences; every target is one plain go command, spelled out in the README.

.PHONY: test race bench bench-always bench-go crashtest quickstart

quickstart:
	go run ./cmd/engine run examples/quickstart/workflow.yaml --input examples/quickstart/input.json

test:
	go test ./...

race:
	go test -race ./engine/... ./kv/... ./schemas/... ./steps/...

# The engine against the bare JetStream floor, medians of 7 rounds.
bench:
	go run ./cmd/engine bench --jobs 1000 --concurrency 100 --rounds 7
	go run ./cmd/engine bench --jobs 20 --concurrency 1 --rounds 7

bench-always:
	go run ./cmd/engine bench --jobs 1000 --concurrency 100 --rounds 7 --sync always

# Hot-path microbenchmarks.
bench-go:
	go test -run '^$$' -bench . -benchmem ./schemas ./engine ./kv ./steps

crashtest:
	go run ./cmd/engine crashtest examples/effects/workflow.yaml --input examples/effects/input.json
