// Package linkcheck holds no code: its test keeps light binaries light.
// A custom worker built with workercmd, and a program that only starts and
// watches jobs, must not link the engine runtime or nats-server; the test
// reads `go list -deps` for each such package and fails naming the import
// chain that brings a forbidden package in.
package linkcheck
