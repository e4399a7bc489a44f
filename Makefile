# Conveniences; every target is one plain go command, spelled out in the README.

.PHONY: test race bench bench-always bench-scale bench-go crashtest quickstart

quickstart:
	go run ./cmd/engine run examples/quickstart/workflow.yaml --input examples/quickstart/input.json

test:
	go test ./...

race:
	go test -race ./engine/... ./kv/... ./schemas/... ./steps/...

# The engine against the bare JetStream floor, medians of 7 rounds.
bench:
	go run ./cmd/engine bench --jobs 1000 --concurrency 100 --rounds 7
	go run ./cmd/engine bench --jobs 50 --concurrency 1 --rounds 7

# Full durability: every write fsynced; file queues, then memory queues.
bench-always:
	go run ./cmd/engine bench --jobs 1000 --concurrency 100 --rounds 7 --sync always
	go run ./cmd/engine bench --jobs 1000 --concurrency 100 --rounds 7 --sync always --queue-storage memory
	go run ./cmd/engine bench --jobs 50 --concurrency 1 --rounds 7 --sync always

# Engine memory with 100 and 10,000 jobs in flight; first progress after a kill.
bench-scale:
	go run ./cmd/engine bench scale --jobs 100,10000

# Hot-path microbenchmarks.
bench-go:
	go test -run '^$$' -bench . -benchmem ./schemas ./engine ./kv ./steps

crashtest:
	go run ./cmd/engine crashtest examples/effects/workflow.yaml --input examples/effects/input.json
