// Package api serves Waymark's HTTP interface (JSON over HTTP/1.1) over a
// client.Client: definitions, jobs, history and effects. `engine serve`
// mounts it; any process with a connection to the deployment can.
package api
