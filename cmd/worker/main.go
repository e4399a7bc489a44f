// Command worker runs a Waymark worker with the built-in step kinds. A
// worker with custom kinds is a small program of its own; see package
// workercmd.
package main

import "github.com/waymark-dev/waymark/workercmd"

func main() { workercmd.Main(nil) }
