// Package cli holds the commands of the engine and worker binaries, so
// that tests drive the real CLI: each command writes to the io.Writers it
// is given and returns an error instead of exiting.
package cli
